"""monitor.py: where metrics go. One `Monitor` per process role (trainer, or an explorer by name).

    mon = Monitor(cfg, role="explorer")
    mon.log({"rollout/reward/mean": 0.4, "time/step": 2.1}, step=3)
    mon.close()

Every metric goes to three places:
- the console (`Console`): on a terminal a tqdm bar per process (step/total, `headline`: reward, policy loss,
  entropy, eval accuracy, tokens/s, s/step; rate and ETA from the end of the first step), elsewhere one short line
  per step ending in the elapsed time and an ETA (`Pace`); and one line per evaluation (`[explorer] eval step 20:
  arith_test accuracy 0.785`). Under the launcher on a terminal, the launcher draws every process's bar from their
  histories (`HistoryTail`). The short lines and the full `key=value` line go to `<job dir>/log/<role>.log`
  (`role_log_file`), with every log record;
- `<job dir>/monitor/<role>.jsonl`, one JSON object per step: the run's history, which plots and
  `summary.json` are made from, and which survives without tensorboard or wandb;
- `monitor.monitor_type`, one sink or several side by side (`[tensorboard, wandb]`, as TRL's report_to): tensorboard
  (`<job dir>/monitor/tensorboard/<role>/`), wandb (project = `project`, run = `<name>_<role>`, as Trinity-RFT names
  them; online or not as wandb decides from its own credentials and WANDB_MODE, offline in `<job dir>/monitor/`
  only when it has none, so a run never blocks on a login: `wandb_run`), mlflow (experiment = `project`, run =
  `<name>_<role>`; a SQLite store in the job's monitor/ unless a tracking URI is given: `MlflowSink`), or none. wandb,
  mlflow (as params, flattened: `mlflow_params`) and tensorboard (as text, `config`) get the resolved config with its
  secrets hidden (`redacted`: every env_vars value, every monitor_args value but the harmless ones, passwords, keys
  and tokens, URL passwords).
Metric names are namespaced as in veRL/Trinity-RFT: rollout/, eval/, actor/, critic/, response_length/,
time/, sync/, perf/ (every record carries the process's peak RSS, perf/max_rss_gb, and on a GPU
perf/max_memory_allocated_gb). An explore step's rollout/ and an evaluation's eval/ metrics are computed here from
the workflows' results (`rollout_metrics`, `eval_metrics`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import netrc
import os
import re
import resource
import statistics
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from configs.checks import redacted
from configs.resolve import CONSOLE
from configs.schema import Config
from dbconn import shown
from errors import ConfigError

log = logging.getLogger("nanorft.monitor")
RSS_PER_GB = 2**30 if sys.platform == "darwin" else 2**20  # getrusage's ru_maxrss: bytes on macOS, KiB on Linux
_OPEN: list[Monitor] = []  # this process's monitors not closed yet (close_monitors)


class Monitor:
    """Console + JSONL history + the configured sinks (tensorboard, wandb, mlflow: any of them, or none)."""

    def __init__(self, cfg: Config, role: str) -> None:
        self.role, self.total = role, cfg.buffer.total_steps or cfg.trainer.total_steps  # shown as step/total
        self.start = time.monotonic()  # the console's elapsed time counts from here (Pace)
        self.dir = Path(cfg.checkpoint_job_dir, "monitor")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.history = History(self.dir / f"{role}.jsonl")  # appends across restarts
        self.failing: set[str] = set()  # the sinks whose last write failed (said once: `sink`)
        self.file_log = role_log_file(cfg.checkpoint_job_dir, role)
        self.console: Console | None = None
        self.tb = self.wandb = self.mlflow = None
        # which of FIELD_NAMES' tables names this process's metrics for veRL / TRL users (a bench process: none)
        self.side = "trainer" if role == cfg.trainer.name else "explorer" if role == cfg.explorer.name else ""
        _OPEN.append(self)
        for kind in cfg.monitor.monitor_type:  # every sink listed, side by side ([none]: none)
            if kind == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter

                try:
                    self.tb = SummaryWriter(log_dir=str(self.dir / "tensorboard" / role))
                except OSError as e:  # a full disk: its first event cannot be written; the run goes on without it
                    log.warning("[%s] no tensorboard events for this process: %s", role, e)
                else:  # its TEXT tab: the resolved config, secrets hidden (an indented block: markdown's code)
                    self.sink("tensorboard", 0, lambda: self.tb.add_text("config", config_text(cfg), 0))
            elif kind == "wandb":
                self.wandb = wandb_run(cfg, role, self.dir)
            elif kind == "mlflow":
                self.mlflow = MlflowSink(cfg, role, self.dir)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Record one step's metrics (plus this process's peak memory); non-numbers and NaN go to the history only."""
        metrics = {
            **field_names(metrics, self.side),
            "perf/max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / RSS_PER_GB,
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            metrics["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        numbers = numbers_of(metrics)
        line = json.dumps({"step": step, "total_steps": self.total, **metrics}, default=str) + "\n"
        self.sink("history", step, lambda: self.history.append(line))
        if self.tb is not None:
            self.sink("tensorboard", step, lambda: self.tb_log(numbers, step))
        if self.wandb is not None:
            self.sink("wandb", step, lambda: self.wandb.log(numbers, step=step))
        if self.mlflow is not None:
            self.sink("mlflow", step, lambda: self.mlflow.log(numbers, step))
        self.file_log.info(
            "[%s] step %d %s", self.role, step, " ".join(f"{k}={v:.4g}" for k, v in sorted(numbers.items()))
        )
        for line in console_lines(self.role, step, self.total, numbers):
            self.file_log.info("%s", line)
        for k, v in metrics.items():  # text entries (preview/...): the history and the log file, not the console
            if isinstance(v, str):
                self.file_log.info("[%s] %s: %s", self.role, k, v)
        if self.console is None and os.environ.get(CONSOLE) != "launcher":  # made here: `total` is known by now
            self.console = Console({self.role: self.total}, bars=bars_wanted(), start=self.start)
        if self.console is not None:
            self.console.step(self.role, step, numbers, self.total)

    def sink(self, name: str, step: int, write: Callable[[], None]) -> None:
        """One sink's write of step `step`. NOTE: a failure (a full disk under the job folder: OSError ENOSPC; a
        tracking server gone) loses that sink's metrics of this step, with a warning said once until it works again
        (it is retried every step); it never stops the process, whose steps are in the DB and checkpoints."""
        try:
            write()
        except Exception as e:  # noqa: BLE001 - any sink's own error: the run goes on
            if name not in self.failing:
                log.warning(
                    "[%s] could not write the metrics of step %d to %s: %s; they are lost there, and it is tried "
                    "again each step (said once)",
                    self.role,
                    step,
                    name,
                    " ".join(str(e).split())[:300],
                )
            self.failing.add(name)
            return
        if name in self.failing:
            self.failing.discard(name)
            log.warning("[%s] the metrics of step %d went to %s again", self.role, step, name)

    def tb_log(self, numbers: dict[str, float], step: int) -> None:
        for k, v in numbers.items():
            self.tb.add_scalar(k, v, step)
        self.tb.flush()

    def close(self, failed: bool = False) -> None:
        """Close every output (a second call does nothing); `failed`: the process stops on an error, and its wandb
        / mlflow run ends as failed."""
        if self not in _OPEN:
            return
        _OPEN.remove(self)
        self.history.close()
        if self.console is not None:
            self.console.close()
        for handler in self.file_log.handlers:  # this role's file: off the root logger too
            close_log_file(handler)
        if self.tb is not None:
            self.sink("tensorboard", -1, self.tb.close)  # a full disk: its last events are lost, said once
        if self.wandb is not None:
            self.wandb.finish(exit_code=int(failed))
        if self.mlflow is not None:
            self.mlflow.close(failed)


# The names veRL and TRL users know for some of nanorft's metrics, by process side: {nanorft name: the field's}.
# `field_names` logs each number under both (computed once, under nanorft's name); docs/metrics.md has the whole
# table, with the metrics whose names already are veRL's (critic/score/mean, response_length/clip_ratio, ...).
FIELD_NAMES: dict[str, dict[str, str]] = {
    "trainer": {
        "time/step": "timing_s/step",  # NOTE: a trainer step's wall time, its wait for the explorer's batch included
        "time/old_logprobs": "timing_s/old_log_prob",
        "time/ref_logprobs": "timing_s/ref",
        "time/values": "timing_s/values",
        "time/adv": "timing_s/adv",  # reward shaping (overlong, KL penalty) and the advantage function, as veRL's
        "time/update": "timing_s/update_actor",  # NOTE: with a critic (gae), its update too (veRL: update_critic)
        "time/sync": "timing_s/update_weights",
        "time/save_checkpoint": "timing_s/save_checkpoint",
        "critic/score/zero_std_ratio": "frac_reward_zero_std",  # TRL's
    },
    "explorer": {
        "time/rollout": "timing_s/gen",  # NOTE: the workflows' reward functions too (veRL: timing_s/reward apart)
        "time/eval": "timing_s/testing",
    },
}


def field_names(metrics: dict[str, Any], side: str) -> dict[str, Any]:
    """`metrics` plus each one that FIELD_NAMES[side] names again, under that name too (the same value)."""
    table = FIELD_NAMES.get(side, {})
    return metrics | {table[k]: v for k, v in metrics.items() if k in table}


def config_text(cfg: Config) -> str:
    """The resolved config, its secrets hidden (`redacted`), as YAML indented by four spaces (a markdown code block:
    tensorboard's text tab renders markdown)."""
    import yaml

    text = yaml.safe_dump(json.loads(json.dumps(redacted(cfg), default=str)), sort_keys=False)
    return "\n".join(f"    {line}" for line in text.splitlines())


class History:
    """A JSONL history file, appended to one whole line at a time: one write() of the line and its newline on a
    file opened O_APPEND; a write cut short (ENOSPC part-way) is truncated away and raised, so a full disk loses a
    record, never leaves half of one. A file that does not end in a newline (a record torn before this was so)
    gets one first: the torn part stays a line of its own, which the readers skip (`records`), and is not glued to
    the next record."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.torn = False  # the file's last line lacks its newline
        size = os.fstat(self.fd).st_size
        if size:
            with open(path, "rb") as f:
                f.seek(size - 1)
                self.torn = f.read(1) != b"\n"

    def append(self, line: str) -> None:
        data = ("\n" if self.torn else "").encode() + line.encode("utf-8", "replace")
        before = os.fstat(self.fd).st_size
        try:
            written = os.write(self.fd, data)
            if written < len(data):
                raise OSError(errno.ENOSPC, f"{written} of {len(data)} bytes written", str(self.path))
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, before)  # NOTE: no half line stays (a second writer of one role: none)
            raise
        self.torn = False

    def close(self) -> None:
        os.close(self.fd)


def close_monitors(failed: bool) -> None:
    """Close the monitors this process left open: a stage that an error ended (a set-up refusal, a named error, a
    traceback) never reached its own close, and its mlflow run would stay RUNNING, its wandb run unfinished
    (launch.run_in_process calls this after every stage)."""
    for monitor in list(_OPEN):
        try:
            monitor.close(failed)
        except Exception as e:  # noqa: BLE001 - e.g. the tracking server gone: the stage's own result stands
            log.warning("could not close the %s monitor: %s", monitor.role, " ".join(str(e).split())[:300])


# wandb's default server (WANDB_BASE_URL or monitor_args.base_url: another): api.wandb.ai, or since wandb 0.22 the
# CoreWeave Forge host in front of it, whose netrc entry wandb also accepts for api.wandb.ai's (and the other way)
WANDB_HOSTS = ("api.wandb.ai", "api.forge.coreweave.com")


def wandb_run(cfg: Config, role: str, folder: Path) -> Any:
    """monitor_type wandb: a run named <name>_<role> in project `project`, files in `folder`, with the resolved
    config (`redacted`). monitor_args (Trinity's): api_key (else WANDB_API_KEY), base_url (else WANDB_BASE_URL). The
    mode is wandb's own choice (WANDB_MODE, its settings, the credentials it finds: `wandb_credentials`); only when
    no credentials are found does the run go offline, so that a run never waits on a login prompt."""
    import wandb

    args = cfg.monitor.monitor_args
    if args.get("api_key"):
        os.environ["WANDB_API_KEY"] = str(args["api_key"])
    if args.get("base_url"):
        os.environ["WANDB_BASE_URL"] = str(args["base_url"])
    found = wandb_credentials(os.environ)
    mode = None if found else "offline"  # None: wandb decides (online unless WANDB_MODE or its settings say not)
    run = wandb.init(
        project=cfg.project,
        name=run_name(cfg, role),
        dir=str(folder),
        mode=mode,
        config=redacted(cfg),
        reinit="create_new",
    )
    why = found or "no W&B credentials found (WANDB_API_KEY, monitor_args.api_key, `wandb login`'s netrc entry)"
    log.info("wandb run %s (%s: %s) in %s", run.name, run.settings.mode, why, folder)
    return run


def wandb_credentials(env: Mapping[str, str]) -> str:
    """Where wandb would find what lets it run online, as a few words ("" = nowhere, a run must go offline):
    WANDB_MODE (wandb honours it: online, offline, disabled), an API key in WANDB_API_KEY, an identity token file
    (WANDB_IDENTITY_TOKEN_FILE), or a key for the server's host (WANDB_BASE_URL, else api.wandb.ai) in the netrc
    file that `wandb login` writes (NETRC, else ~/.netrc, else ~/_netrc), as wandb reads them; not a key kept
    in wandb's own settings files (none of its commands writes one there). Reads files only:
    nothing here reaches the network."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        if env.get(name):
            return f"{name}={env[name]}" if name == "WANDB_MODE" else name
    host = urllib.parse.urlsplit(env.get("WANDB_BASE_URL", "")).netloc
    hosts = WANDB_HOSTS if not host or host.endswith("forge.coreweave.com") or host in WANDB_HOSTS else (host,)
    home = Path(env.get("HOME") or Path.home())
    files = [Path(env["NETRC"]).expanduser()] if env.get("NETRC") else [home / ".netrc", home / "_netrc"]
    path = next((f for f in files if f.is_file()), None)
    if path is None:
        return ""
    try:
        entries = netrc.netrc(str(path))
    except (netrc.NetrcParseError, OSError) as e:
        log.warning("wandb: cannot read %s (%s); looking for no key there", path, " ".join(str(e).split()))
        return ""
    found = [h for h in hosts if (entry := entries.authenticators(h)) and entry[2]]
    return f"a key for {found[0]} in {path}" if found else ""


def run_name(cfg: Config, role: str) -> str:
    """A process's wandb or mlflow run: <name>_<role> (a `/` of a stage's name made `_`)."""
    return f"{cfg.name}_{role}".replace("/", "_")


def fail_left_runs(stage: Config, roles: list[str], since: float) -> None:
    """After a failed stage, the launcher: the processes it stopped (SIGTERM, then SIGKILL) never closed their
    monitors, and their mlflow runs (MlflowSink's <stage name>_<role> for these Monitor `roles`, started since
    `since`, a time.time()) would stay RUNNING: they end FAILED here (an error of the tracking store is a warning).
    NOTE: wandb runs of killed processes are left as wandb finds them."""
    if "mlflow" not in stage.monitor.monitor_type:
        return
    try:
        client, _ = mlflow_client(stage, Path(stage.checkpoint_job_dir, "monitor"))
        experiment = client.get_experiment_by_name(stage.project)
        names = {run_name(stage, role) for role in roles}
        left = (
            [
                r
                for r in client.search_runs([experiment.experiment_id], "attributes.status = 'RUNNING'")
                if r.info.run_name in names and r.info.start_time >= since * 1000
            ]
            if experiment
            else []
        )
        for run in left:
            client.set_terminated(run.info.run_id, status="FAILED")
    except Exception as e:  # noqa: BLE001 - mlflow's own errors, or the network's: the stage's exit code stands
        log.warning("stage %s: could not end its mlflow runs: %s", stage.name, " ".join(str(e).split())[:300])
        return
    if left:
        log.info("stage %s: %d mlflow run(s) of its stopped processes ended FAILED", stage.name, len(left))


class MlflowSink:
    """monitor_type mlflow: experiment = `project`, run = `<name>_<role>`, the resolved config (`redacted`) as the
    run's params, flattened (`algorithm.optimizer.lr`: `mlflow_params`, so that runs can be filtered by them) and as
    its config.json. monitor_args (Trinity's): uri (else MLFLOW_TRACKING_URI, else a SQLite store,
    <job dir>/monitor/mlflow.db, its artifacts in <job dir>/monitor/mlartifacts: a run never waits on a server, and
    mlflow's own client and `mlflow ui --backend-store-uri sqlite:///<that file>` read it as it is; under the launcher,
    <run dir>/monitor/mlflow.db for every stage: `prepare_mlflow`), username / password (else
    MLFLOW_TRACKING_USERNAME / _PASSWORD). mlflow refuses some characters in metric names (`@` of `mean@1`): they
    become `_` (`mlflow_key`)."""

    def __init__(self, cfg: Config, role: str, folder: Path) -> None:
        self.client, uri = mlflow_client(cfg, folder)
        experiment = mlflow_experiment(self.client, uri, cfg.project)
        self.run = self.client.create_run(experiment, run_name=run_name(cfg, role)).info.run_id
        try:
            plain = json.loads(json.dumps(redacted(cfg), default=str))
            params = list({p.key: p for p in mlflow_params(plain)}.values())  # two keys made one by mlflow_key: one
            for i in range(0, len(params), 100):  # mlflow's limit of params per batch
                self.client.log_batch(self.run, params=params[i : i + 100])
            self.client.log_dict(self.run, plain, "config.json")
        except BaseException:  # no Monitor holds this sink yet: nothing else would end its run
            self.close(failed=True)
            raise
        log.info("mlflow run %s (experiment %s) at %s", self.run, cfg.project, shown(uri))

    def log(self, numbers: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), v, now, step) for k, v in numbers.items()]
        for i in range(0, len(metrics), 1000):  # mlflow's limit per batch
            self.client.log_batch(self.run, metrics=metrics[i : i + 1000])

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run, status="FAILED" if failed else "FINISHED")


def mlflow_client(cfg: Config, folder: Path) -> tuple[Any, str]:
    """(MlflowClient, tracking URI) as MlflowSink's docstring says; monitor_args' username / password go to mlflow's
    environment variables (its client reads them there)."""
    try:
        from mlflow.tracking import MlflowClient
    except ImportError as e:
        raise ImportError("monitor_type mlflow needs mlflow: pip install -e '.[mlflow]'") from e
    args = cfg.monitor.monitor_args
    for key, env in (("username", "MLFLOW_TRACKING_USERNAME"), ("password", "MLFLOW_TRACKING_PASSWORD")):
        if args.get(key):
            os.environ[env] = str(args[key])
    uri = args.get("uri") or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(folder / 'mlflow.db').resolve()}"
    if uri.startswith("file:"):  # NOTE: mlflow 3 asks for this opt-in before it writes a file store (one given)
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    if uri.startswith("sqlite:"):  # NOTE: mlflow-skinny lacks what its SQL stores need; its client says so late
        try:
            import sqlalchemy  # noqa: F401, I001 - the first of the two named when neither is there
            import alembic  # noqa: F401
        except ImportError as e:
            raise ImportError(f"monitor_type mlflow's SQLite store needs {e.name}: pip install -e '.[mlflow]'") from e
    with store_lock(uri), logging_kept():  # NOTE: the client's constructor makes a new SQLite store's tables
        return MlflowClient(uri), uri


@contextlib.contextmanager
def logging_kept() -> Iterator[None]:
    """The root logger's handlers and level put back after the block. NOTE: a new SQLite store's tables are made by
    mlflow's alembic migrations, whose env.py in older mlflow (3.3, the floor) calls logging.config.fileConfig: that
    replaced the root logger's handlers (the role's log file, the console) with alembic.ini's stderr handler, and the
    launcher's log file stayed empty from then on (tests/test_launch.py's staged run, on the floors)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """An exclusive lock on a local tracking store (a file store's folder, a SQLite file: a lock file beside it,
    the folder made first) while the block runs; none for a server."""
    database = sqlite_file(uri)
    if database is None and not uri.startswith("file:"):
        yield
        return
    store = database or Path(urllib.parse.unquote(urllib.parse.urlparse(uri).path))
    (store.parent if database else store).mkdir(parents=True, exist_ok=True)
    with open(store.parent / f".{store.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def sqlite_file(uri: str) -> Path | None:
    """The database file of a `sqlite:///` tracking URI (None for any other store)."""
    return Path(uri[len("sqlite:///") :]) if uri.startswith("sqlite:///") else None


def mlflow_params(config: dict, parent: str = "") -> list[Any]:
    """A (redacted, plain) config as mlflow params: one per leaf, named by its path (`algorithm.optimizer.lr`; a
    list is one value, in JSON), within mlflow's limits: a key of at most 250 characters (`mlflow_key`'s), a value
    of at most 6000 (cut, ending in `...`)."""
    from mlflow.entities import Param

    out = []
    for key, value in config.items():
        name = f"{parent}.{key}" if parent else str(key)
        if isinstance(value, dict) and value:
            out += mlflow_params(value, name)
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        out.append(Param(mlflow_key(name)[:250], text if len(text) <= 6000 else text[:5997] + "..."))
    return out


def mlflow_experiment(client: Any, uri: str, name: str) -> str:
    """The id of experiment `name`, created if missing. NOTE: get-then-create races when two processes start at
    once: on a server the loser's create fails (RESOURCE_ALREADY_EXISTS) and it looks the experiment up again; a
    local store (a file store: names are not checked atomically, two experiments of one name) holds its lock over
    the two steps (`store_lock`). The launcher creates it before any process starts (`prepare_mlflow`) anyway. A
    new experiment of a SQLite store keeps its artifacts beside the database (<folder>/mlartifacts)."""
    from mlflow.exceptions import MlflowException

    database, artifacts = sqlite_file(uri), None
    if database is not None:  # NOTE: else mlflow puts them in ./mlruns of whatever the working directory is
        artifacts = (database.parent / "mlartifacts").resolve().as_uri()
    with store_lock(uri):
        found = client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return client.create_experiment(name, artifact_location=artifacts)
        except MlflowException:  # another process created it a moment ago: take that one
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id


def prepare_mlflow(stages: list[Config], run_dir: str | Path) -> None:
    """The launcher, once per run, before it starts any process: with monitor_type mlflow, the experiment of each
    stage's project is created here (the processes then only find it), and without a tracking URI (monitor_args.uri,
    MLFLOW_TRACKING_URI) every stage logs to one SQLite store, <run dir>/monitor/mlflow.db, which the processes are
    given in MLFLOW_TRACKING_URI. ConfigError when mlflow is not installed or its tracking store cannot be used."""
    for stage in stages:
        if "mlflow" not in stage.monitor.monitor_type:
            continue
        try:
            client, uri = mlflow_client(stage, Path(run_dir, "monitor"))
        except ImportError as e:
            raise ConfigError(f"monitor.monitor_type mlflow: {e}") from None
        if not stage.monitor.monitor_args.get("uri"):
            os.environ["MLFLOW_TRACKING_URI"] = uri
        try:
            mlflow_experiment(client, uri, stage.project)
        except Exception as e:  # mlflow's own errors, or the network's: the message names the cause
            raise ConfigError(
                f"monitor.monitor_args.uri (or MLFLOW_TRACKING_URI) {shown(uri)}: cannot create the "
                f"experiment {stage.project!r}: {' '.join(str(e).split())[:500]}"
            ) from None


def mlflow_key(key: str) -> str:
    """A metric or param name mlflow accepts (alphanumerics, _ - . space /): `eval/x/accuracy/mean@1` ->
    `.../mean_1`."""
    return re.sub(r"[^A-Za-z0-9_\-. /]", "_", key)


# What a person watches, in this order: for each name, the first key matching its first pattern that matches any,
# in sorted order (the rest are in the history, tensorboard / wandb and the role's log file). reward: the explorer's
# rollout reward, the trainer's mean reward of the step's experiences (critic/score/mean: the same number for the same
# experiences, masked or not). loss: the policy loss (veRL's actor/pg_loss; mix's usual part; else the loss's own
# <name>_loss: sft_loss, dpo_loss, opmd_loss, a registered loss's), never the entropy or KL term (NOTE: a bare
# actor/*_loss pattern took actor/entropy_loss, alphabetically first, for every ppo-family loss). entropy: its own.
HEADLINE = (
    ("reward", (r"^rollout/reward/mean$", r"^critic/score/mean$")),
    ("loss", (r"^actor/pg_loss$", r"^actor/usual/pg_loss$", r"^actor/(?!entropy_loss$|kl_loss$)\w+_loss$")),
    ("entropy", (r"^actor/entropy$",)),
    ("acc", (r"^(eval|bench)/[^/]+/accuracy/mean@\d+$",)),
    ("tok/s", (r"^(rollout/tokens_per_s|perf/throughput)$",)),
    ("s/step", (r"^time/(step|rollout)$",)),
)


def headline(numbers: dict[str, float]) -> str:
    """The console's line of a step: a few numbers, e.g. `reward 0.54 loss 0.0174 entropy 5.21 tok/s 7456 s/step
    3.1`."""
    out = []
    for name, patterns in HEADLINE:
        key = next((k for pattern in patterns for k in sorted(numbers) if re.match(pattern, k)), None)
        if key is not None:
            out.append(f"{name} {numbers[key]:.4g}")
    return " ".join(out) or f"{len(numbers)} metrics"


def numbers_of(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics record (what the console and the sinks show)."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def console_lines(role: str, step: int, total: int | None, numbers: dict[str, float]) -> list[str]:
    """A step's readable lines: `[trainer] step 3/10 loss 0.0174 ...`, and `[explorer] eval step 20: ...` after an
    evaluation."""
    lines = [f"[{role}] step {f'{step}/{total}' if total else step} {headline(numbers)}"]
    if evals := eval_line(numbers):
        lines.append(f"[{role}] {evals[0]} step {step}: {evals[1]}")
    return lines


def eval_line(numbers: dict[str, float]) -> tuple[str, str] | None:
    """("eval" or "bench", "arith_test accuracy 0.785, ...") for a step with evaluation metrics (accuracy, else
    reward, mean over the k runs), or None."""
    found = [
        m.groups() + (v,)
        for k, v in sorted(numbers.items())
        if (m := re.match(r"^(eval|bench)/([^/]+)/(accuracy|reward)/mean@\d+$", k))
    ]
    if not found:
        return None
    accuracy = {name for _, name, metric, _ in found if metric == "accuracy"}
    shown = [f"{name} {metric} {v:.3f}" for _, name, metric, v in found if metric == "accuracy" or name not in accuracy]
    return found[0][0], ", ".join(shown)


def bars_wanted(stream: TextIO | None = None) -> bool:
    """Whether `stream` (stderr) is a terminal that can draw progress bars: not a file, a pipe or TERM=dumb."""
    stream = stream or sys.stderr
    if not stream.isatty() or os.environ.get("TERM") == "dumb":
        return False
    try:
        return os.get_terminal_size(stream.fileno()).columns > 0  # 0: a terminal without a size (tqdm draws nothing)
    except (OSError, ValueError):
        return True


class Pace:
    """One role's elapsed time and ETA. NOTE: the ETA counts from the end of the first step seen (step 1, or a resumed
    run's first; not an explorer's step 0, its evaluation before training): the start-up before it (models, engines,
    the first sync: ~30 s of the tiny run) is not a step's time, and counted as one it made the first ETAs several
    times too long. `start`: when the process (or the launcher's stage) started, for the elapsed time."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.first: tuple[float, int] | None = None  # (time, step) at the end of the first step seen

    def mark(self, step: int, now: float) -> bool:
        """Note that `step` ended at `now`; True for the first step that starts the steady state."""
        if self.first is None and step >= 1:
            self.first = (now, step)
            return True
        return False

    def eta(self, step: int, total: int | None, now: float) -> float | None:
        """Seconds left: the mean time of the steps since the first times the steps left (None before a second)."""
        if self.first is None or not total or step <= self.first[1]:
            return None
        t0, s0 = self.first
        return (now - t0) / (step - s0) * max(total - step, 0)

    def text(self, step: int, total: int | None, now: float) -> str:
        """`elapsed 1:02 eta 3:45` (no eta before the second step seen)."""
        eta = self.eta(step, total, now)
        return f"elapsed {clock(now - self.start)}" + ("" if eta is None else f" eta {clock(eta)}")


def clock(seconds: float) -> str:
    """Seconds as M:SS, or H:MM:SS from an hour: 75 -> 1:15, 3725 -> 1:02:05."""
    m, s = divmod(int(round(max(seconds, 0.0))), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Console:
    """What a person watching the run sees. With `bars`: one tqdm bar per role (step/total, the headline numbers,
    ETA), evaluation lines and every log record printed above the bars. Without: one line per step and per
    evaluation on stderr, the step's line ending in the elapsed time and the ETA (`Pace`). Console only: the log files
    get their lines from `Monitor`. `start`: when the process started (time.monotonic(); default now), `clock`: the
    time (tests)."""

    def __init__(
        self,
        totals: dict[str, int | None],
        bars: bool,
        file: TextIO | None = None,
        start: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.file, self.clock = file or sys.stderr, clock
        start = clock() if start is None else start
        self.paces = {role: Pace(start) for role in totals}
        self.bars: dict[str, tqdm] = {}
        self.redirect = logging_redirect_tqdm() if bars else None  # log records above the bars, not through them
        if self.redirect is not None:
            self.redirect.__enter__()
            self.bars = {
                role: tqdm(
                    total=total, desc=role, position=i, file=self.file, unit="step", dynamic_ncols=True, leave=True
                )
                for i, (role, total) in enumerate(totals.items())
            }

    def step(self, role: str, step: int, numbers: dict[str, float], total: int | None = None) -> None:
        lines, now = console_lines(role, step, total, numbers), self.clock()
        pace = self.paces.setdefault(role, Pace(now))
        first = pace.mark(step, now)
        bar = self.bars.get(role)
        if bar is None:
            lines[0] += " " + pace.text(step, total, now)
            self.note(*(f"{time.strftime('%H:%M:%S')} {line}" for line in lines))
            return
        if total and bar.total != total:
            bar.total = total
        bar.set_postfix_str(headline(numbers), refresh=False)
        if first:  # NOTE: the rate and ETA count from the end of this step (Pace), not from the bar's start-up
            bar.n = bar.initial = bar.last_print_n = step
            bar.start_t = bar.last_print_t = bar._time()  # tqdm's own clock (its attribute; no public reset keeps n)
        else:
            bar.update(max(step - bar.n, 0))
        bar.refresh()
        self.note(*lines[1:])

    def note(self, *lines: str) -> None:
        """Lines for the console (above the bars when there are bars)."""
        for line in lines:
            if self.bars:
                tqdm.write(line, file=self.file)
            elif log.isEnabledFor(logging.INFO):  # log.level WARNING quiets the lines as it did the log records
                print(line, file=self.file, flush=True)

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()
        if self.redirect is not None:
            self.redirect.__exit__(None, None, None)
            self.redirect = None


class HistoryTail:
    """The records another process appends to its JSONL history (`Monitor`), as they come: only records written
    after this was made (from_start: all of them, e.g. the studio's run page), and only complete lines."""

    def __init__(self, path: str | Path, from_start: bool = False) -> None:
        self.path = Path(path)
        self.offset = self.path.stat().st_size if self.path.exists() and not from_start else 0
        self.lines = 1  # the number of the first line not read yet, for the warnings (counted from here)

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        done = data[: data.rfind(b"\n") + 1]
        self.offset += len(done)
        self.lines += done.count(b"\n")
        return records(done, self.path, self.lines - done.count(b"\n"))


def log_to_file(job_dir: str, role: str) -> logging.Handler:
    """Every log record of this process from now on also goes to <job dir>/log/<role>.log (appended across
    restarts); the caller removes the returned handler from the root logger when done (`close_log_file`)."""
    path = Path(job_dir, "log", f"{role}.log")
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = LogFile(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S"))
    logging.getLogger().addHandler(handler)
    return handler


class LogFile(logging.FileHandler):
    """A log file whose write failures (a full disk) are one line on stderr, said once until it works again, not
    logging's traceback for every record."""

    failing = failed = False  # the last record's write failed; this record's did (handleError, inside emit)

    def emit(self, record: logging.LogRecord) -> None:
        self.failed = False
        super().emit(record)
        self.failing = self.failed

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        if not self.failing:
            print(f"could not write to the log file {self.baseFilename}: {sys.exc_info()[1]}", file=sys.stderr)
        self.failed = True


def close_log_file(handler: logging.Handler) -> None:
    logging.getLogger().removeHandler(handler)
    handler.close()


def role_log_file(job_dir: str, role: str) -> logging.Logger:
    """The process's log file (`log_to_file`), plus a logger that writes to it only: for the full metric lines,
    which the console leaves out."""
    handler = log_to_file(job_dir, role)
    file_only = logging.getLogger(f"nanorft.metrics.{role}")
    file_only.propagate, file_only.level = False, logging.INFO
    file_only.handlers = [handler]
    return file_only


def preview(exps: list, width: int = 300) -> dict[str, str]:
    """trainer.enable_preview: the lowest- and highest-reward samples of a step as text entries of the history
    (`preview/lowest`, `preview/highest`: reward, prompt and response, cut to `width` characters each)."""
    scored = [x for x in exps if x.reward is not None]
    if not scored:
        return {}
    out = {}
    for key, x in (("lowest", min(scored, key=lambda e: e.reward)), ("highest", max(scored, key=lambda e: e.reward))):
        out[f"preview/{key}"] = f"reward {x.reward:.4g} | {x.prompt_text[-width:]!r} -> {x.response_text[:width]!r}"
    return out


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def rollout_metrics(results: list, seconds: float) -> dict[str, float]:
    """Trinity/veRL-named metrics of one explore step; rollout/<component>/mean|max|min over the tasks that have the
    component (each task's value: the mean over its runs that have it), and /count (of responses) when some lack it."""
    exps = [x for _, got, _ in results if got for x in got]
    rewards = [x.reward for x in exps]
    lengths = [x.response_length for x in exps]
    out = {
        "rollout/reward/mean": mean(rewards),
        "rollout/reward/std": statistics.pstdev(rewards) if rewards else 0.0,
        "rollout/failed_count": sum(got is None for _, got, _ in results),
        "rollout/finished_task_count": sum(got is not None for _, got, _ in results),
        "rollout/experience_count": len(exps),
        "rollout/model_version": max((x.model_version for x in exps), default=0),
        # explorer.partial_rollout: responses whose weights changed while they ran (Experience.spans), and their
        # tokens sampled by weights newer than the response's model_version (the oldest)
        "rollout/partial_responses": sum(bool(x.spans) for x in exps),
        "rollout/tokens_from_new_weights": sum(x.response_length - x.spans[1][0] for x in exps if x.spans),
        "response_length/mean": mean(lengths),
        "response_length/max": max(lengths, default=0),
        "response_length/clip_ratio": mean([x.truncate_status == "response_truncated" for x in exps]),
        "rollout/tokens_per_s": sum(lengths) / seconds if seconds > 0 else 0.0,
        "time/rollout": seconds,
        **dropped(results, "rollout"),
    }
    runs = [components(got) for _, got, _ in results if got]
    for k in sorted({k for r in runs for k in r} - {"reward"}):  # task value = mean over its runs (Trinity)
        values = [mean(r[k]) for r in runs if k in r]
        out.update(
            {f"rollout/{k}/mean": mean(values), f"rollout/{k}/max": max(values), f"rollout/{k}/min": min(values)}
        )
        if (had := sum(len(r[k]) for r in runs if k in r)) < len(exps):  # a component only some responses have
            out[f"rollout/{k}/count"] = had
    return out


def score_metrics(scores: torch.Tensor, rewards: torch.Tensor, groups: torch.Tensor) -> dict[str, float]:
    """A train step's sequence scores and rewards as veRL names them: critic/score/* the scores [B] (the reward
    functions', plus overlong shaping: veRL's token_level_scores summed), critic/rewards/* the rewards [B] the
    advantage function sees (token_level_rewards summed: the KL penalty in, when there is one); and
    critic/score/zero_std_ratio (TRL's frac_reward_zero_std), the fraction of groups (`groups` [B]: 0..G-1) whose
    scores are all equal: their advantages are 0 under GRPO-style baselines. NOTE: over groups, not TRL's over
    samples (the same when groups are the same size); a group of one counts as tied (TRL's std is 0 there too)."""
    n = int(groups.max()) + 1
    low = torch.full((n,), math.inf).scatter_reduce(0, groups, scores.float(), "amin")  # [G]
    high = torch.full((n,), -math.inf).scatter_reduce(0, groups, scores.float(), "amax")  # [G]
    return {
        **{f"critic/score/{k}": v for k, v in spread(scores).items()},
        **{f"critic/rewards/{k}": v for k, v in spread(rewards).items()},
        "critic/score/zero_std_ratio": torch.isclose(low, high).float().mean().item(),
    }


def spread(x: torch.Tensor) -> dict[str, float]:
    """mean, max and min of a tensor (as floats)."""
    x = x.float()
    return {"mean": x.mean().item(), "max": x.max().item(), "min": x.min().item()}


def dropped(results: list, prefix: str) -> dict[str, Any]:
    """The dropped tasks of `results` by why (explore.Drop's reason): <prefix>/dropped/<reason> counts them, and the
    text entry <prefix>/dropped_errors (the history and the log file) names each task and its error."""
    failed = [(task, err) for task, got, err in results if got is None]
    out: dict[str, Any] = {}
    for _, err in failed:
        key = f"{prefix}/dropped/{getattr(err, 'reason', '') or 'workflow'}"
        out[key] = out.get(key, 0) + 1
    if failed:
        shown = [f"{getattr(t, 'task_id', t)} ({getattr(e, 'reason', '') or 'workflow'}): {e}"[:300] for t, e in failed]
        out[f"{prefix}/dropped_errors"] = "; ".join(shown)[:4000]
    return out


def components(got: list) -> dict[str, list[float]]:
    """A task's runs as {metric: its values}: "reward", and each number in the experiences' metrics, over the runs
    that have it. NOTE: not the first run's keys: a reward function may add a component to some responses only (that
    was a KeyError in every later step, on every relaunch); a value that is not a number is left out."""
    out: dict[str, list[float]] = {"reward": [x.reward for x in got]}
    for x in got:
        for k, v in x.metrics.items():
            if isinstance(v, (int, float)) and k != "reward":
                out.setdefault(k, []).append(float(v))
    return out


def eval_metrics(name: str, results: list, k: int, prefix: str = "eval", detailed: bool = False) -> dict[str, float]:
    """eval/<taskset>/<metric>/mean@k, std@k, best@k, worst@k over tasks, for reward and each reward component (over
    the runs that have it, and then their count: `components`); `detailed` (monitor.detailed_stats) adds the max, min
    and std across tasks of the per-task means."""
    done = [got for _, got, _ in results if got]
    out = {f"{prefix}/{name}/finished_task_count": len(done), f"{prefix}/{name}/failed_count": len(results) - len(done)}
    out |= dropped(results, f"{prefix}/{name}")
    runs = [components(got) for got in done]
    for m in sorted({m for r in runs for m in r}):
        per_task = [r[m] for r in runs if m in r]  # each task's runs that have it (components)
        means = [mean(v) for v in per_task]
        out[f"{prefix}/{name}/{m}/mean@{k}"] = mean(means)
        out[f"{prefix}/{name}/{m}/std@{k}"] = mean([statistics.pstdev(v) for v in per_task])
        out[f"{prefix}/{name}/{m}/best@{k}"] = mean([max(v) for v in per_task])
        out[f"{prefix}/{name}/{m}/worst@{k}"] = mean([min(v) for v in per_task])
        if (had := sum(map(len, per_task))) < sum(map(len, done)):  # a component only some responses have
            out[f"{prefix}/{name}/{m}/count"] = had
        if detailed:
            out |= {
                f"{prefix}/{name}/{m}/max_over_tasks@{k}": max(means),
                f"{prefix}/{name}/{m}/min_over_tasks@{k}": min(means),
                f"{prefix}/{name}/{m}/std_over_tasks@{k}": statistics.pstdev(means),
            }
    return out


def read_history(path: str | Path) -> list[dict]:
    """The JSONL history a Monitor wrote (for plots and summaries), its garbled lines skipped (`records`)."""
    return records(Path(path).read_bytes(), Path(path))


def records(data: bytes, path: Path, first_line: int = 1) -> list[dict]:
    """The records of JSONL `data` (of file `path`): each line a JSON object with an integer "step". A line that is
    not (half a record that a full disk or a kill cut short, bytes that are not UTF-8) is skipped with a warning
    naming the file and the line, never an exception: every later launcher of the job reads these files."""
    out = []
    for n, raw in enumerate(data.split(b"\n"), first_line):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            rec, why = None, f"{type(e).__name__}: {e}"
        else:
            why = "not a record with an integer step"
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int) or isinstance(rec["step"], bool):
            log.warning("%s, line %d: skipped (%s): %r", path, n, why[:200], raw[:80])
            continue
        out.append(rec)
    return out


@contextlib.contextmanager
def timer(timing: dict[str, float], key: str) -> Iterator[None]:
    """Seconds spent in the block, as timing[key] (the `time/...` metrics)."""
    start = time.monotonic()
    yield
    timing[key] = time.monotonic() - start
