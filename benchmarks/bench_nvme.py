"""NVMe tier step time against the raw O_DIRECT floor of the same bytes and the in-RAM step.

  python benchmarks/bench_nvme.py --numel 32M --dir /tmp            # fp32 moments
  python benchmarks/bench_nvme.py --numel 32M --precision bf16 --json out.json

A bf16 model (four parameters of numel/4) is updated three ways, interleaved per repeat so
a noisy machine slows all alike, each reported as a median:

- in-RAM: AdamBridge with its state in host memory (the update alone);
- tier: AdamBridge(offload_dir=DIR, host_budget=0): every page read, updated and written
  back through O_DIRECT, fsynced and committed;
- raw floor: the same bytes in the same pattern on the tier's own files (read each page's
  committed slot, write its other slot, records of the tier's size, the same queue depth,
  then fdatasync) with no update: the I/O alone, through the tier's own engine (io_uring
  or the thread pool) and through the other one;
- chained floor: that I/O through the tier's own loop (nvme_stream.PageStream, its ring and
  order) on the floor's engine, with the update left out: what the order costs;
- side by side: the raw floor's I/O and one in-RAM step at once, in two threads, with no
  order between them: what this machine gives when both run together (on this VM they share
  one core and the memory bandwidth the virtual disk copies through);
- fio (when installed): a mixed sequential read/write of the same bytes, direct=1, libaio.

Goals: tier >= 0.85 of the raw floor's speed, and tier step <= 1.1x
max(raw floor, in-RAM step), where the floor is the best of the two raw loops and fio: the
best the disk gives. Before timing, the tier is checked bit for bit against RAM.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adambridge import AdamBridge  # noqa: E402
from adambridge.lab import trust  # noqa: E402
from adambridge.nvme.tier import OffloadConfig  # noqa: E402
from adambridge.nvme.engine import open_engine  # noqa: E402
from adambridge.nvme.direct_io import AlignedBuffer  # noqa: E402
from adambridge.nvme.layout import PageLayout  # noqa: E402
from adambridge.nvme.stream import PageStream, StreamJob  # noqa: E402


def _numel(text: str) -> int:
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1].upper(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


def _model(numel: int, parts: int = 4) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel // parts, generator=gen).bfloat16())
              for _ in range(parts)]
    grads = [torch.randn(p.shape, generator=gen).bfloat16() for p in params]
    return params, grads


def _step(opt: AdamBridge, params: list, grads: list) -> float:
    for p, g in zip(params, grads):
        p.grad = g
    began = time.perf_counter()
    opt.step()
    return time.perf_counter() - began


def validate(precision: str, directory: Path, args) -> None:
    """The tier equals the in-RAM state bit for bit (params and moments) on a small model."""
    results = []
    for offload in (None, OffloadConfig([directory], page_size=args.page_size,
                                        queue_depth=args.queue_depth, io_engine=args.io_engine)):
        params, grads = _model(3 * args.page_size + 4 * 333)
        opt = AdamBridge(params, precision=precision, offload_dir=offload,
                         host_budget=0 if offload else None)
        for _ in range(3):
            _step(opt, params, grads)
        results.append((params, opt.state_dict()["state"]))
        del opt
    (ram_params, ram_state), (tier_params, tier_state) = results
    for p, q in zip(ram_params, tier_params):
        assert torch.equal(p, q), "tier params differ from in-RAM params"
    for i in ram_state:
        assert ram_state[i].keys() == tier_state[i].keys(), i
        for key, value in ram_state[i].items():  # every stored value (fp8: codes and scales)
            assert torch.equal(value, tier_state[i][key]), (i, key)
    for name in os.listdir(directory):
        os.unlink(directory / name)


class _IOOnlyStream(PageStream):
    """The tier's streaming loop with the update taken out."""

    @staticmethod
    def _update(opt, job, k, buffer, backend) -> None:
        return None


class RawFloor:
    """The tier's I/O without the update: each page's committed slot read and its other slot
    written, on the tier's own files (the same extents, so where the disk placed a file cannot
    favour either side), in records of the tier's size at its queue depth, then fdatasync.
    The other slot is the one the tier's next step overwrites anyway: its state is unharmed."""

    def __init__(self, tier, engine: str, queue_depth: int) -> None:
        self.tier = tier
        self.record = tier.layout.record_bytes
        self.pool = open_engine(engine, queue_depth)
        self.buffers = [AlignedBuffer(self.record) for _ in range(queue_depth + 1)]
        self.pool.register(self.buffers)  # as the tier's page ring
        self.stream = _IOOnlyStream(self.pool)
        self.stream.buffers = self.buffers  # its ring: the same registered buffers

    def _pages(self) -> list:
        pages = []
        for files in self.tier._files.values():
            generation = self.tier._committed[files.index][0]
            for k in range(files.num_pages):
                file, read_at = files.locate(k, generation)
                pages.append((file, read_at, files.locate(k, generation + 1)[1]))
        return pages

    def time(self) -> float:
        began = time.perf_counter()
        futures, files = [], {}
        for k, (file, read_at, write_at) in enumerate(self._pages()):
            files[id(file)] = file
            buffer = self.buffers[k % len(self.buffers)]
            futures.append(self.pool.read(file, buffer, read_at, self.record))
            futures.append(self.pool.write(file, buffer, write_at, self.record))
            while len(futures) > self.pool.queue_depth:
                self.pool.wait(futures.pop(0))  # queue_depth requests in flight, as the tier
        error = self.pool.drain(futures)
        if error is not None:
            raise error
        for file in files.values():
            file.sync()
        return time.perf_counter() - began

    def time_chained(self) -> float:
        """The tier's own paged loop (nvme_stream.PageStream: its ring, its read-ahead, its
        write order) on this floor's engine, with the update left out: page k's write after
        its read, a read into a buffer only once that buffer's write is done. Against
        ``time()`` it prices the tier's dependencies; against the tier, the update."""
        began = time.perf_counter()
        jobs = [StreamJob(None, None, 0, None, None, files, None,
                          self.tier._committed[files.index][0])
                for files in self.tier._files.values()]
        self.stream.run(None, jobs, "native")
        for files in self.tier._files.values():
            for file in files.files:
                file.sync()
        return time.perf_counter() - began

    def close(self) -> None:
        self.pool.close()


def side_by_side(floor: RawFloor, ram: AdamBridge, params: list, grads: list) -> float:
    """The floor's I/O and one in-RAM step of the same model at once, in two threads (the
    kernel and the ring's reaps release the GIL): the best any interleaving of this update with
    this I/O could do on this machine, where both share its memory system and its one core."""
    for p, g in zip(params, grads):
        p.grad = g
    began = time.perf_counter()
    worker = threading.Thread(target=ram.step)
    worker.start()
    floor.time()
    worker.join()
    return time.perf_counter() - began


def time_publishes(tier) -> list:
    """Wrap ``tier._publish`` (the commit: fdatasync of the data files, manifest staged and
    fsynced, rename) so each call's seconds are appended to the returned list."""
    seconds, publish = [], tier._publish

    def timed(*args, **kwargs):
        began = time.perf_counter()
        try:
            return publish(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - began)

    tier._publish = timed
    return seconds


def fio_seconds(directory: Path, nbytes: int, record: int, queue_depth: int) -> float | None:
    """fio's time for the same bytes read and written, direct=1, libaio; None without fio."""
    if shutil.which("fio") is None:
        return None
    path = directory / "fio.dat"
    cmd = ["fio", "--name=floor", f"--filename={path}", "--direct=1", "--rw=rw",
           "--rwmixread=50", f"--bs={record}", f"--size={2 * nbytes}", "--ioengine=libaio",
           f"--iodepth={queue_depth}", "--end_fsync=1", "--output-format=json"]
    subprocess.run(cmd[:-1] + ["--rw=write", "--output-format=terse"], check=True,
                   capture_output=True)  # lay the file out first, as the tier's files are
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    os.unlink(path)
    return job["job_runtime"] / 1000.0


def run(args) -> dict:
    directory = Path(tempfile.mkdtemp(prefix="adambridge-bench-", dir=args.dir))
    try:
        validate(args.precision, directory, args)
        return _measure(args, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _measure(args, directory: Path) -> dict:
    params, grads = _model(args.numel)
    ram_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ram = AdamBridge(ram_params, precision=args.precision, num_threads=args.threads)
    tier = AdamBridge(params, precision=args.precision, host_budget=0, num_threads=args.threads,
                      offload_dir=OffloadConfig([directory], page_size=args.page_size,
                                                queue_depth=args.queue_depth,
                                                io_engine=args.io_engine))
    engine = tier.nvme_tier.pool.name
    other = "threads" if engine == "io_uring" else "io_uring"
    layout = PageLayout(args.precision, args.page_size)
    pages = sum(-(-p.numel() // args.page_size) for p in params)
    nbytes = pages * layout.record_bytes
    for _ in range(2):  # the first tier step writes only (new state); the second warms up
        _step(ram, ram_params, grads), _step(tier, params, grads)
    commits = time_publishes(tier.nvme_tier)
    floors = {"floor": RawFloor(tier.nvme_tier, engine, args.queue_depth)}
    try:
        floors["floor_other"] = RawFloor(tier.nvme_tier, other, args.queue_depth)
    except ValueError:  # io_uring refused here: the tier runs on threads, so does the floor
        pass
    times = {"ram": [], "tier": [], "io_wait": [], "commit": [], "chained": [], "together": [],
             **{k: [] for k in floors}}
    monitor = trust.LoadMonitor(args.threads or os.cpu_count() or 1)
    for _ in range(args.repeats):
        monitor.sample()
        times["ram"].append(_step(ram, ram_params, grads))
        times["tier"].append(_step(tier, params, grads))
        times["io_wait"].append(tier.last_step_stats.io_wait_s)
        times["commit"].append(commits.pop())
        for name, floor in floors.items():
            times[name].append(floor.time())
        times["chained"].append(floors["floor"].time_chained())
        times["together"].append(side_by_side(floors["floor"], ram, ram_params, grads))
    for floor in floors.values():
        floor.close()
    verdict = trust.judge({k: times[k] for k in ("ram", "tier", "floor")}, monitor)
    med = {k: statistics.median(v) for k, v in times.items()}
    med.setdefault("floor_other", None)
    med["fio"] = fio_seconds(directory, nbytes, layout.record_bytes, args.queue_depth)
    best = min(s for s in (med["floor"], med["floor_other"], med["fio"]) if s is not None)
    step_s = med["tier"]
    return dict(
        setup=dict(numel=args.numel, precision=args.precision, page_size=args.page_size,
                   queue_depth=args.queue_depth, record_bytes=layout.record_bytes,
                   bytes_each_way=nbytes, dir=str(args.dir), cpus=os.cpu_count(),
                   platform=platform.platform(), torch=torch.__version__,
                   load_average=os.getloadavg()[0],
                   backend=tier.backend, io_engine=engine, other_engine=other,
                   threads=args.threads,
                   direct=all(f.direct for pf in tier._tier._files.values() for f in pf.files)),
        seconds=med,
        floor_over_tier=best / step_s,
        same_engine_floor_over_tier=med["floor"] / step_s,
        tier_over_bound=step_s / max(best, med["ram"]),
        tier_over_together=step_s / med["together"],
        tier_gbps=2 * nbytes / step_s / 1e9,
        floor_gbps=2 * nbytes / med["floor"] / 1e9,
        dwpd_3_84tb=tier._tier.drive_writes_per_day(int(3.84e12), step_s=step_s),
        trust=verdict.figures, trust_line=verdict.line,
    )


def report(result: dict) -> None:
    s, setup = result["seconds"], result["setup"]
    print(f"setup: {setup['numel'] / 2**20:.0f}M params, {setup['precision']} moments, page "
          f"{setup['page_size']} elements ({setup['record_bytes'] >> 10} KiB records), queue "
          f"depth {setup['queue_depth']}, {setup['bytes_each_way'] / 1e6:.0f} MB read + written "
          f"per step, O_DIRECT {'yes' if setup['direct'] else 'no'}, dir {setup['dir']}, "
          f"{setup['backend']}, kernel threads {setup['threads'] or 'all'}, I/O engine "
          f"{setup['io_engine']}, {setup['cpus']} cpus, load average {setup['load_average']:.1f}")
    print(result["trust_line"])
    print("| variant | ms | GB/s (read+write) |\n|---|---:|---:|")
    nbytes = 2 * setup["bytes_each_way"]
    rows = [("in-RAM step", s["ram"]), ("tier step", s["tier"]),
            (f"raw floor, {setup['io_engine']}, same bytes", s["floor"]),
            (f"raw floor, {setup['other_engine']}, same bytes", s["floor_other"]),
            (f"chained floor, {setup['io_engine']} (the tier's order, no update)", s["chained"]),
            ("raw floor and in-RAM step side by side (two threads)", s["together"]),
            ("fio rw, same bytes", s["fio"])]
    for name, seconds in rows:
        if seconds is None:
            print(f"| {name} | not available here | |")
        else:  # the in-RAM step moves no file bytes: no GB/s
            rate = "" if name == "in-RAM step" else f"{nbytes / seconds / 1e9:.2f}"
            print(f"| {name} | {seconds * 1e3:.1f} | {rate} |")
    print(f"tier I/O wait: {s['io_wait'] * 1e3:.1f} ms of {s['tier'] * 1e3:.1f} ms; commit "
          f"(fdatasyncs, manifest, rename): {s['commit'] * 1e3:.1f} ms")
    print(f"best floor/tier = {result['floor_over_tier']:.2f} (goal >= 0.85; same-engine "
          f"floor/tier = {result['same_engine_floor_over_tier']:.2f}); "
          f"tier/max(best floor, RAM) = {result['tier_over_bound']:.2f} (goal <= 1.10); "
          f"tier/side by side = {result['tier_over_together']:.2f}")
    print(f"endurance: {result['dwpd_3_84tb']:.1f} drive writes/day on one 3.84 TB drive at "
          f"this step rate")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=_numel, default=_numel("16M"))
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp8"))
    parser.add_argument("--page-size", type=int, default=1 << 18)
    parser.add_argument("--queue-depth", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None,
                        help="native kernel threads (default: all); fewer leaves a core for I/O")
    parser.add_argument("--io-engine", default="auto", choices=("auto", "io_uring", "threads"),
                        help="the tier's I/O engine (OffloadConfig.io_engine)")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    result = run(args)
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
