"""The Data-Juicer side of pipelines/data_juicer.py: run by `.venv-dj/bin/python pipelines/dj_worker.py`, a separate
process in Data-Juicer's own virtualenv (py-data-juicer pins dill / multiprocess / emoji versions that the project's
environment does not have; Trinity-RFT runs it as a separate service for the same reason).

It imports nothing of nanorft: the standard library and data_juicer only (this file is not importable from the
project's venv, and must not need to be).

    python dj_worker.py ops RESULT.json             # RESULT.json <- the names of Data-Juicer's registered operators
    python dj_worker.py run RECIPE.json RESULT.json  # run the recipe (its dataset_path -> its export_path)

A recipe is a Data-Juicer config (JSON is YAML): `process`, `np`, `text_keys`, plus the I/O keys the project writes
(dataset_path, export_path, work_dir, keep_stats_in_res_ds). On success RESULT.json holds {"ok": true, ...}; on any
failure {"error": "<type>: <Data-Juicer's message>"} and the exit code is 3 (Data-Juicer's own log goes to stderr).
"""

import json
import sys


def no_installs() -> None:
    """Data-Juicer's LazyLoader pip-installs (with uv) any module an operator imports and lacks: torch, ray, ...
    (a text filter's run installed both, 5 GB). Refuse instead: the import fails with its ImportError, which the code
    that asked for an optional module handles, and an operator that truly needs one fails, naming it."""
    from data_juicer.utils.lazy_loader import LazyLoader

    def refuse(package_spec, pip_args=None):
        raise ImportError(
            f"{package_spec} is not installed in this Data-Juicer venv (nanorft installs nothing at run time)"
        )

    # NOTE: a patch, for want of a switch: LazyLoader(auto_install=False) is per call site, inside data_juicer
    LazyLoader._install_package = staticmethod(refuse)


class NoTorch:
    """torch where it is not installed, for data_juicer.utils.model_utils: Data-Juicer 1.6.1 calls
    torch.cuda.empty_cache() after every operator (free_models), model or not, and .venv-dj has no torch (the text
    operators need none; a CPU torch is a large download). Anything else asked of it fails, naming torch."""

    class cuda:  # noqa: N801 (torch's name)
        @staticmethod
        def empty_cache() -> None:
            pass

        @staticmethod
        def is_available() -> bool:
            return False

    def __getattr__(self, name: str):
        raise ImportError(f"torch.{name}: this operator needs torch, which the Data-Juicer venv (.venv-dj) lacks")


def no_torch() -> None:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        import data_juicer.utils.model_utils as model_utils

        model_utils.torch = NoTorch()  # NOTE: its module global, a LazyLoader that would pip-install torch


def list_ops() -> dict:
    from data_juicer.ops import OPERATORS

    return {"ok": True, "ops": sorted(OPERATORS.modules)}


def run(recipe_path: str) -> dict:
    from data_juicer.config import init_configs
    from data_juicer.core.executor.default_executor import DefaultExecutor

    cfg = init_configs(args=["--config", recipe_path])
    dataset = DefaultExecutor(cfg).run()
    return {"ok": True, "rows_out": len(dataset), "export_path": cfg.export_path}


def main(argv: list) -> int:
    if len(argv) < 2 or argv[0] not in ("ops", "run") or (argv[0] == "run" and len(argv) != 3):
        print(__doc__, file=sys.stderr)
        return 2
    result_path = argv[-1]
    try:
        no_installs()
        no_torch()
        result = list_ops() if argv[0] == "ops" else run(argv[1])
        code = 0
    except BaseException as e:  # NOTE: SystemExit too: jsonargparse exits on a bad config after printing why
        result, code = {"error": f"{type(e).__name__}: {e}"}, 3
    with open(result_path, "w") as f:
        json.dump(result, f)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
