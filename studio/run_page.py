"""The run page: a run (or one stage's job) directory's curves from its monitor files, per stage on the global step
axis, refreshed while the run goes, and its summary when it ends. studio/runs.py reads the files; this script only
lays them out.

Open one as /run?job=PATH (the address follows the job box, so a reload shows the same run). The elements a browser
test finds carry keys: the inputs run_job, run_found, run_metrics, run_live, run_per_stage; the containers run_state,
run_curves, run_chart_<curve> (<curve>: its name, each character outside [A-Za-z0-9_-] as _), run_summary, run_error
(Streamlit gives each a class st-key-<key>).
"""

import re
from pathlib import Path

import altair as alt
import pandas as pd
import streamlit as st

from errors import DataError
from launch import stage_segments
from studio import runs

REFRESH_S = 2.0  # how often the curves are read again while the page is open (runs.RunReader reads new lines only)
CHECKPOINTS = Path("checkpoints")  # where `bash run.sh` writes its runs (checkpoint.root_dir's default)
PANELS_WIDTH = 760  # the per-stage panels' width in all (pixels)
STEP_AXIS = alt.Axis(format="d", tickMinStep=1)  # global steps are whole
STATUS = {"running": st.info, "finished": st.success, "failed": st.error, "stopped": st.warning}


def pick_found() -> None:
    """A run picked in the list becomes the job box's value."""
    if st.session_state.get("run_found"):
        st.session_state["run_job"] = st.session_state["run_found"]


def job_input() -> str:
    """The job directory: the box (first from ?job=), or a run found under ./checkpoints; ?job= follows the box."""
    if "run_job" not in st.session_state:
        st.session_state["run_job"] = st.query_params.get("job", "")
    found = [str(p) for p in runs.find_runs(CHECKPOINTS)] if CHECKPOINTS.is_dir() else []
    if found:
        st.selectbox(
            "runs under ./checkpoints", found, index=None, key="run_found", on_change=pick_found, placeholder="pick one"
        )
    job = st.text_input("job directory", key="run_job", help="a run dir (<root>/<project>/<name>) or a job dir")
    job = job.strip()
    if job:
        st.query_params["job"] = job
    elif "job" in st.query_params:
        del st.query_params["job"]
    return job


def reader_of(job: str) -> runs.RunReader:
    """The session's reader of `job` (made again when the box names another directory): each refresh reads only
    the lines added since the last."""
    held = st.session_state.get("run_reader")
    if held is None or held.path != Path(job).expanduser():
        held = st.session_state["run_reader"] = runs.RunReader(job)
    return held


def keep_picks() -> None:
    """The picked curves, kept apart from the widget: its options grow as a run writes new metrics."""
    st.session_state["run_picks"] = st.session_state["run_metrics"]


def metric_picker(reader: runs.RunReader) -> list[str]:
    """The curves to draw: the groups (reward, accuracy, loss: runs.GROUPS) first, then every metric recorded."""
    picks = st.session_state.setdefault("run_picks", list(runs.GROUPS))
    options = list(runs.GROUPS) + [m for m in reader.metrics() if m not in runs.GROUPS]
    return st.multiselect(
        "curves",
        options,
        default=[p for p in picks if p in options],
        key="run_metrics",
        on_change=keep_picks,
        help="; ".join(f"{k}: {v}" for k, v in runs.GROUPS.items()),
    )


def show_state(state: runs.State) -> None:
    """A line: running (stage, step / total), finished, failed or stopped, and a failed run's last log lines."""
    with st.container(key="run_state"):
        STATUS[state.status](state.line)
        for name, text in state.logs.items():
            with st.expander(f"log/{name}: last lines", expanded=state.status == "failed"):
                st.code(text, language=None)


def chart(rows: list[dict], name: str, spans: list[dict], per_stage: bool) -> alt.TopLevelMixin:
    """One curve name's chart: a line per stage (colour) over the global steps; per_stage: a panel per stage, as
    wide as reward_accuracy.png's segment of it (launch.stage_segments: 60 RFT steps after 600 SFT steps are not
    squashed, a bench stage's point is narrow), else one axis with dotted rules where a stage begins."""
    data = pd.DataFrame(rows)
    lines = (
        alt.Chart(data)
        .mark_line(point=True)
        .encode(
            x=alt.X("global_step:Q", title="global step", scale=alt.Scale(zero=False, nice=False), axis=STEP_AXIS),
            y=alt.Y("value:Q", title=name, scale=alt.Scale(zero=False)),
            color=alt.Color("line:N", title="curve", legend=alt.Legend(orient="bottom", labelLimit=400)),
            tooltip=["line", "metric", "step", "global_step", "value"],
        )
    )
    if per_stage:
        segments = [s for s in stage_segments({"stages": spans}) if s["name"] in set(data["stage"])]
        unit = PANELS_WIDTH / sum(s["width"] for s in segments)
        panels = [
            lines.transform_filter(alt.datum.stage == s["name"]).properties(
                width=int(unit * s["width"]), height=240, title=s["name"]
            )
            for s in segments
        ]
        shared = "shared" if name == "accuracy" else "independent"  # accuracies compare; losses differ in scale
        return alt.hconcat(*panels, title=name).resolve_scale(x="independent", y=shared)
    starts = pd.DataFrame([{"first_step": s["first_step"], "stage": s["name"]} for s in spans if s["first_step"] > 0])
    lines = lines.properties(title=name)
    if starts.empty:
        return alt.layer(lines)
    rules = alt.Chart(starts).mark_rule(strokeDash=[3, 3], color="gray").encode(x="first_step:Q", tooltip=["stage"])
    return alt.layer(lines, rules)


def show_curves(reader: runs.RunReader, picks: list[str]) -> None:
    """A chart per picked curve, or a line saying that the run has not recorded it yet."""
    spans = reader.spans()
    per_stage = st.toggle("each stage at its own scale", value=True, key="run_per_stage")
    with st.container(key="run_curves"):
        for name in picks:
            slug = re.sub(r"[^A-Za-z0-9_-]", "_", name)
            with st.container(key=f"run_chart_{slug}"):
                rows = reader.series(name)
                if rows:
                    st.altair_chart(chart(rows, name, spans, per_stage))
                else:
                    st.caption(f"{name}: nothing recorded yet")


def show_summary(reader: runs.RunReader) -> None:
    """summary.json's figures once the run has ended: accuracies, wall time, steps, checkpoint, and the plot."""
    summary = reader.summary
    if summary is None:
        return
    with st.container(key="run_summary"):
        st.subheader("summary")
        for col, (label, value) in zip(st.columns(len(runs.SUMMARY_FIELDS)), runs.summary_view(summary).items()):
            col.metric(label, "—" if value is None else str(value))
        st.markdown(f"accuracy metric: `{summary.get('accuracy_metric')}`")
        st.markdown(f"checkpoint: `{summary.get('checkpoint')}`")
        if (reader.path / runs.PLOT).is_file():
            with st.expander(runs.PLOT):
                st.image(str(reader.path / runs.PLOT))


def live_part(reader: runs.RunReader) -> None:
    """What a refresh redraws: the state, the picker, the curves and the summary, from the lines added since."""
    try:
        reader.poll()
        state = runs.state(reader)
    except DataError as e:
        st.error(str(e), icon="⚠️")
        return
    show_state(state)
    show_curves(reader, metric_picker(reader))
    show_summary(reader)


# --- the page

st.title("Run")
job = job_input()
if not job:
    st.info("Give a run directory (e.g. checkpoints/nanorft/tiny) or one stage's job dir, or open /run?job=PATH.")
    st.stop()
try:
    reader = reader_of(job)
except DataError as e:
    with st.container(key="run_error"):
        st.error(str(e))
    st.stop()
ended = reader.summary is not None and runs.launcher_alive(reader.path) is None  # nothing more will be written
live = st.toggle(
    "follow the run", value=not ended, key="run_live", help=f"read the monitor files again every {REFRESH_S:g} s"
)
st.fragment(live_part, run_every=REFRESH_S if live else None)(reader)
