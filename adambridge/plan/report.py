"""A plan as a person reads it (the setup lines, one table, the recommendation) or as JSON."""
from __future__ import annotations

import json
from typing import Optional

COLUMNS = ("setup", "GPU GB", "w+g+s+a", "fits", "host GB", "link GB", "link s", "update s",
           "bwd s", "exposed s", "step s", "vs GPU", "hides at", "NVMe s", "DWPD", "life mo")
LEGEND = (
    "GPU GB: one GPU's memory at the peak of a step, w+g+s+a: its weights, gradients (as the "
    "setup's mode holds them), optimizer state and activations",
    "fits: the GPU and the host within their usable memory; host GB: host RAM (state and "
    "pinned staging; NVMe rows: what stays in RAM)",
    "link GB, link s: bytes over the host link per step and their seconds (AdamBridge rows: "
    "both directions on one budget; streamed: each direction at once)",
    "update s: the optimizer's update (host kernel; streamed: the slower of its host DRAM "
    "traffic and its GPU update); bwd s: the backward the host work overlaps",
    "exposed s: the host work backward does not hide; step s, vs GPU: the step's seconds and "
    "their ratio to all-GPU AdamW's; hides at: tokens per backward that would hide it",
    "NVMe s, DWPD, life mo: drive seconds per step, drive writes per day, months until the "
    "drive's rated writes are used up",
    "GB here are 1e9 bytes, with no buffer factor; DeepSpeed's estimate_zero2/3_model_states_"
    "mem_needs prints GiB (2^30 bytes) as \"GB\", multiplies its CPU figure by "
    "additional_buffer_factor=1.5 and counts no activations: its GPU figure x 1.074, or its CPU "
    "figure x 1.074 / 1.5, is in these units",
)


def _num(value: Optional[float], digits: int = 3) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    return f"{value:,.0f}" if abs(value) >= 10 ** digits else f"{value:.{digits}g}"


def _tokens(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value / 1e3:,.1f}K" if value >= 1e3 else f"{value:.0f}"


def _fits(row) -> str:
    if row.fits:
        return "yes"
    return "no: " + "+".join(w for w, ok in (("GPU", row.gpu_fits), ("host", row.host_fits)) if not ok)


def _gb(value: float) -> str:
    return f"{value:,.1f}" if value >= 0.95 or value == 0 else f"{value:.2g}"


def cells(row) -> list:
    """One table row as the strings the table prints."""
    parts = "+".join(_gb(v) for v in (row.gpu_params_gb, row.gpu_grads_gb, row.gpu_state_gb,
                                       row.gpu_activations_gb))
    return [row.name, f"{row.gpu_total_gb:,.1f}", parts, _fits(row), _num(row.host_ram_gb),
            _num(row.link_gb), _num(row.link_s),
            _num(row.host_update_s), _num(row.backward_s), _num(row.exposed_s), _num(row.step_s),
            f"{row.vs_all_gpu:.2f}x", _tokens(row.hiding_tokens), _num(row.nvme_s),
            _num(row.drive_writes_per_day), _num(row.drive_life_months)]


def setup_lines(plan) -> list:
    m, w, g, h, n = plan.model, plan.work, plan.gpu, plan.host, plan.nvme
    cpus = "/".join(str(c) for c in h.cpus_per_node)
    return [
        f"model: {m.total:,} parameters, {m.trainable:,} trainable ({m.source}; {m.trainable_source})",
        f"work: {w.tokens_per_step:,} tokens per step per GPU in {w.accumulation} pass(es), "
        f"{w.gpus} GPU(s), {w.parallel}{', activation checkpointing' if w.checkpointing else ''}",
        f"GPU: {g.name}, {g.memory_gb:,.1f} GB ({plan.gpu_usable_gb:,.1f} usable), {g.tflops:g} "
        f"TFLOP/s bf16 achieved, link {g.link_gbps:g} GB/s"
        f"{f' (PCIe Gen{g.pcie_gen})' if g.pcie_gen else ''}, memory {g.hbm_gbps:,.0f} GB/s [{g.source}]",
        f"host: {h.bw_gbps:.1f} GB/s [{h.bw_source}], {h.ram_gb:,.1f} GB RAM "
        f"({plan.host_usable_gb:,.1f} usable) [{h.ram_source}], {h.numa_nodes} NUMA node(s), "
        f"CPUs per node {cpus}; update arithmetic {_ceiling(h)} [{h.update_source}]",
        f"NVMe: {n.gbps:g} GB/s, {n.drive_tb:g} TB rated {n.dwpd:g} DWPD",
    ]


def _ceiling(host) -> str:
    if not host.update_ns:
        return "not bounding"
    return ", ".join(f"{p} {ns:.2f} ns/element" for p, ns in host.update_ns)


def table(rows: list, columns=COLUMNS) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(str(c)) for c in column) for column in zip(columns, *rows)]
    lines = []
    for index, row in enumerate([list(columns), *rows]):
        parts = [str(row[0]).ljust(widths[0])] + [str(c).rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(parts).rstrip())
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def memory_lines(plan) -> list:
    """What the GPU column rests on (activations, async mode's gradients, what is in flight)
    and the host's checkpoint peak, one line each."""
    return [line for line in (plan.activations, _async_line(plan), _checkpoint_line(plan)) if line]


def _async_line(plan) -> str:
    row = next((r for r in plan.rows if r.kind in ("offload", "sharded")), None)
    if row is None:
        return ""
    line = f"async mode's gradients on the GPU: {_gb(row.gpu_grads_gb)} GB ({row.gpu_grads_note})"
    if row.gpu_in_flight_gb:
        line += (f"; in flight over the link when backward ends: up to {_gb(row.gpu_in_flight_gb)} "
                 f"GB more of released gradients, reserved by the caching allocator (not "
                 f"allocated), which waits for those copies before it would run out")
    return line


def _checkpoint_line(plan) -> str:
    head = ("checkpoint: a save or load of the host state adds at most the largest parameter's "
            "state beyond what torch.optim.AdamW adds on the same path")
    extra = [(r.precision, r.checkpoint_extra_gb) for r in plan.rows
             if r.kind == "offload" and r.checkpoint_extra_gb is not None]
    if not extra:
        return head + " (give --model to size it)"
    return head + ": " + ", ".join(f"{p} +{_gb(gb)} GB" for p, gb in extra)


def render(plan) -> str:
    """The whole plan as text: setup lines, the table and its legend, the memory lines, the
    recommendation and its reasons."""
    out = setup_lines(plan) + ["", table([cells(r) for r in plan.rows])]
    out += [f"  {line}" for line in LEGEND] + [""] + memory_lines(plan)
    out += ["", f"Recommendation: {plan.advice.summary}"]
    out += [f"  {reason}" for reason in plan.advice.reasons]
    out += [f"note: {note}" for note in plan.notes]
    return "\n".join(out)


def to_json(plan, check=None) -> str:
    data = plan.to_dict()
    if check is not None:
        data["check"] = check.to_dict()
    return json.dumps(data, indent=2)


def section(plan, check=None) -> dict:
    """The fields of a lab report section (adambridge.lab.report.Section) for this plan."""
    notes = [*LEGEND, *memory_lines(plan), f"Recommendation: {plan.advice.summary}",
             *plan.advice.reasons, *plan.notes]
    if check is not None:
        notes += check.lines()
    return dict(name="plan", title="Will offload pay here? (adambridge plan)",
                setup="; ".join(setup_lines(plan)), columns=list(COLUMNS),
                rows=[cells(r) for r in plan.rows], notes=notes,
                figures=dict(plan=plan.to_dict(), check=check.to_dict() if check else None))
