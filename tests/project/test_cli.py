"""python -m adambridge: info diagnoses and self-checks, build prints the library, forwarding works."""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from adambridge import cli
from adambridge._native import loader

ROOT = Path(__file__).resolve().parents[2]
INFO_FIELDS = ("adambridge", "torch", "python", "platform", "compiler", "cache", "isa forced",
               "backend", "isa detected", "isa compiled", "library", "threads", "numa nodes",
               "l2 cache", "plan checks", "cuda devices", "check fp32", "check bf16", "result")


@pytest.fixture(autouse=True)
def _fresh_memos():
    loader.reset()
    yield
    loader.reset()


def test_cli_info_prints_the_fields_and_passes():
    # One real end-to-end run of `python -m adambridge`, in the session's cache.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-m", "adambridge", "info"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    printed = {line.split(":", 1)[0].strip() for line in done.stdout.splitlines() if ":" in line}
    assert set(INFO_FIELDS) <= printed, done.stdout
    assert "result:         PASS" in done.stdout
    assert "backend:        native/" in done.stdout


def test_cli_info_fails_without_native(monkeypatch, capsys):
    monkeypatch.setenv("ADAMBRIDGE_DISABLE_NATIVE", "1")
    assert cli.main(["info"]) == 1
    out = capsys.readouterr().out
    assert "native:         unavailable:" in out and "result:         FAIL" in out


def test_cli_info_reports_a_bad_isa_setting(monkeypatch, capsys):
    monkeypatch.setenv("ADAMBRIDGE_ISA", "bogus")
    assert cli.main(["info"]) == 1
    assert "ADAMBRIDGE_ISA='bogus' is not an instruction set" in capsys.readouterr().out


def test_cli_build_prints_an_existing_path(capsys):
    assert cli.main(["build"]) == 0
    path = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert path.is_file() and path == loader.library_path()


def test_cli_bench_needs_a_source_checkout(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "BENCH_SCRIPT", tmp_path / "benchmarks" / "bench_kernels.py")
    assert cli.main(["bench", "--sizes", "1"]) == 1
    assert "needs a source checkout" in capsys.readouterr().err


def test_cli_bench_forwards_arguments(monkeypatch, tmp_path):
    script = tmp_path / "bench_kernels.py"
    script.write_text("import sys\nsys.exit(7 if sys.argv[1:] == ['--sizes', '1'] else 3)\n")
    monkeypatch.setattr(cli, "BENCH_SCRIPT", script)
    assert cli.main(["bench", "--sizes", "1"]) == 7


def test_cli_demo_forwards_arguments(monkeypatch):
    seen = []
    fake = types.ModuleType("adambridge.lab.demo")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "adambridge.lab.demo", fake)
    # `from .lab import demo` prefers the package attribute, set once any test imported it.
    import adambridge.lab
    monkeypatch.setattr(adambridge.lab, "demo", fake, raising=False)
    assert cli.main(["demo", "--steps", "3", "--help-me"]) == 0
    assert seen == [["--steps", "3", "--help-me"]]


def test_cli_lab_forwards_arguments(monkeypatch):
    seen = []
    import adambridge.lab.app as app
    monkeypatch.setattr(app, "main", lambda argv, prog: seen.append((argv, prog)) or 5)
    assert cli.main(["lab", "run", "--preset", "quick"]) == 5
    assert seen == [(["run", "--preset", "quick"], "python -m adambridge lab")]


def _usage(capsys, run) -> str:
    """What a --help or a usage error printed (both exit through argparse's SystemExit)."""
    with pytest.raises(SystemExit):
        run()
    captured = capsys.readouterr()
    return captured.out + captured.err


# sys.argv[0] as each entry point has it: pip's console scripts (Linux, and Windows' .exe
# launcher), and python -m adambridge (its __main__.py).
SCRIPT_DIR = Path(sys.executable).parent


@pytest.mark.parametrize("argv0, argv, usage", [
    (str(SCRIPT_DIR / "adambridge-lab"), ["--help"], "usage: adambridge-lab [-h]"),
    (str(SCRIPT_DIR / "adambridge-lab"), ["run", "--help"], "usage: adambridge-lab run [-h]"),
    (str(SCRIPT_DIR / "adambridge-lab"), ["run"],
     "adambridge-lab run: error: the following arguments are required: --preset"),
    (str(SCRIPT_DIR / "adambridge-lab.exe"), ["--help"], "usage: adambridge-lab [-h]"),
    (str(ROOT / "adambridge" / "__main__.py"), ["--help"], "usage: python -m adambridge lab [-h]"),
], ids=["script", "script run", "script run error", "windows script", "python -m"])
def test_lab_app_names_the_command_as_invoked(monkeypatch, capsys, argv0, argv, usage):
    import adambridge.lab.app as app
    monkeypatch.setattr(sys, "argv", [argv0, *argv])
    said = _usage(capsys, app.main)
    assert usage in said and "python -m adambridge lab" not in said.replace(usage, ""), said


@pytest.mark.parametrize("argv0, usage", [
    (str(SCRIPT_DIR / "adambridge"), "usage: adambridge lab run [-h]"),
    (str(ROOT / "adambridge" / "__main__.py"), "usage: python -m adambridge lab run [-h]"),
], ids=["adambridge script", "python -m adambridge"])
def test_cli_lab_names_the_command_as_invoked(monkeypatch, capsys, argv0, usage):
    monkeypatch.setattr(sys, "argv", [argv0, "lab", "run", "--help"])
    assert usage in _usage(capsys, cli.main)


def test_installed_lab_script_help_names_itself():
    script = SCRIPT_DIR / ("adambridge-lab.exe" if os.name == "nt" else "adambridge-lab")
    if not script.exists():
        pytest.skip(f"the adambridge-lab script is not installed in {SCRIPT_DIR} (pip install -e .)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: adambridge-lab [-h]"), done
    done = subprocess.run([sys.executable, "-m", "adambridge", "lab", "--help"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: python -m adambridge lab [-h]"), done


@pytest.mark.parametrize("argv, code", [([], 2), (["nope"], 2)], ids=["no command", "unknown command"])
def test_cli_usage_errors(argv, code, capsys):
    if argv:
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == code
    else:
        assert cli.main(argv) == code
    captured = capsys.readouterr()
    assert "info" in captured.out + captured.err and "lab" in captured.out + captured.err
