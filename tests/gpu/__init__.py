"""GPU tests (marked ``gpu``), run by scripts/gpu_check.sh; a package so its conftest is not ``conftest``."""
