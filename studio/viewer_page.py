"""The experience viewer: any experience DB (a SQLite path or a PostgreSQL URL), read-only, as a table with filters
and, for one experience, its tokens coloured by a chosen quantity with the numbers on hover, and its group's
responses side by side. Opened on a DB by the address: `?db=PATH_OR_URL` (and `&exp=ID`, `&model=FOLDER`).

The reading is studio/expdb.py's (paged queries, read-only connections, escaped HTML); this script is the widgets.
A browser test finds: the table (key viewer_table), the experience shown (`div.exp-shown` with data-exp-id), its tokens
(`div.toks` of `span.tok`, data-adv / data-lp / data-tlp / data-mask / data-value on each), the group
(`div.group-member` with data-exp-id, data-reward).
"""

import math

import streamlit as st

from errors import DataError
from studio.expdb import (
    ORDERS,
    QUANTITIES,
    STATUSES,
    DBReadError,
    ExpDB,
    Filters,
    NotAnExperienceDB,
    job_model,
    load_tokenizer,
    token_rows,
    tokens_html,
)

PAGE_SIZES = (25, 50, 100, 200)


def from_address(name: str, key: str, cast: type = str) -> None:
    """A widget's initial value from the address (?name=...), once per session (a value that does not cast: none)."""
    if key not in st.session_state and name in st.query_params:
        try:
            st.session_state[key] = cast(st.query_params[name])
        except ValueError:
            st.query_params.pop(name)


def in_address(name: str, value: object) -> None:
    """Keep the address in step with an input (a reload shows the same), dropping it when empty."""
    if value in (None, ""):
        st.query_params.pop(name, None)
    elif st.query_params.get(name) != str(value):
        st.query_params[name] = str(value)


@st.cache_resource(show_spinner="loading the tokenizer")
def tokenizer_of(model: str):
    return load_tokenizer(model)


def bounds(label: str, key: str, cast: type) -> tuple:
    """Two number inputs (from, to) in one row; (lo, hi), None where empty."""
    lo, hi = st.columns(2)
    step = 1 if cast is int else 0.1
    a = lo.number_input(f"{label} from", value=None, step=step, key=f"{key}_lo")
    b = hi.number_input(f"{label} to", value=None, step=step, key=f"{key}_hi")
    return tuple(None if x is None else cast(x) for x in (a, b))


def filters_form(db: ExpDB) -> Filters:
    """The filters, in the sidebar."""
    with st.sidebar:
        st.subheader("Filters")
        f = Filters(
            step=bounds("train step", "viewer_step", int),
            reward=bounds("reward", "viewer_reward", float),
            response_length=bounds("response length", "viewer_len", int),
        )
        versions = db.choices("model_version")
        version = st.selectbox("model version", [None, *versions], key="viewer_version")
        f.model_version = (version, version)
        f.explorer = st.selectbox("explorer", [None, *db.choices("explorer")], key="viewer_explorer")
        f.status = st.selectbox("status", [None, *STATUSES], key="viewer_status")
        f.group_id = st.text_input("group id", key="viewer_group") or None
        f.task_id = st.text_input("task id", key="viewer_task") or None
    return f


def pick_row() -> None:
    """The table's selection callback: the selected row's id becomes the experience shown."""
    rows = st.session_state["viewer_table"].selection.rows
    if rows:
        st.session_state["viewer_exp"] = st.session_state["viewer_page_ids"][rows[0]]


def table(db: ExpDB, f: Filters) -> list[dict]:
    """The table of experiences: one page of the filtered, sorted rows; the page's rows."""
    total = db.count(f)
    a, b, c, d = st.columns([2, 1, 1, 1])
    order = a.selectbox("sort by", ORDERS, key="viewer_order")
    descending = b.toggle("descending", key="viewer_desc")
    size = c.selectbox("rows a page", PAGE_SIZES, index=1, key="viewer_size")
    pages = max(1, math.ceil(total / size))
    page = d.number_input(f"page (of {pages})", min_value=1, max_value=pages, value=1, step=1, key="viewer_page")
    rows = db.page(f, order=order, descending=descending, offset=(page - 1) * size, limit=size)
    st.caption(
        f"{total} experiences match; rows {(page - 1) * size + 1 if rows else 0}-{(page - 1) * size + len(rows)}"
    )
    st.session_state["viewer_page_ids"] = [r["id"] for r in rows]
    st.dataframe(
        rows,
        key="viewer_table",
        on_select=pick_row,
        selection_mode="single-row",
        hide_index=True,
        column_config={"step": st.column_config.NumberColumn(format="%d")},
    )
    return rows


def on_open(db: ExpDB) -> None:
    """A DB opened (first, or in place of another): the job's model folder for its token text, when it lies in a job
    directory (else the one given: ?model=, or the last one); another DB's experience shown no more."""
    from_address("model", "viewer_model")
    previous = st.session_state.get("viewer_open")
    if previous == db.where:
        return
    st.session_state["viewer_open"] = db.where
    found = job_model(db.path)
    if found and (previous is not None or not st.session_state.get("viewer_model")):
        st.session_state["viewer_model"] = found
    st.session_state.setdefault("viewer_model", "")
    if previous is not None:
        st.session_state.pop("viewer_exp", None)
        st.query_params.pop("exp", None)


def tokenizer_input(db: ExpDB):
    """The model folder for token text (default: the job's model when the DB lies in <job dir>/buffer/); its
    tokenizer, or None: token ids are shown."""
    model = st.text_input("model folder (for token text)", key="viewer_model", help="empty: token ids are shown")
    in_address("model", model)
    if not model:
        st.caption("no model folder: tokens are shown as their ids")
        return None
    try:
        return tokenizer_of(model)
    except DataError as e:
        st.warning(f"{e}; tokens are shown as their ids")
        return None


def experience_view(db: ExpDB, exp_id: int, tokenizer) -> None:
    """One experience: its numbers, its tokens coloured by the chosen quantity, then its group side by side."""
    try:
        exp, trained = db.experience(exp_id)
    except KeyError as e:
        st.warning(str(e.args[0]))
        return
    st.subheader(f"Experience {exp.id}")
    st.caption(
        f"reward {exp.reward} · group {exp.group_id!r} run {exp.run_id} · task {exp.task_id!r} · model version "
        f"{exp.model_version} · explorer {exp.explorer!r} · prompt {exp.prompt_length} + response "
        f"{exp.response_length} tokens · {exp.truncate_status or 'not truncated'}"
    )
    a, b = st.columns(2)
    quantity = a.radio("colour by", list(QUANTITIES), horizontal=True, key="viewer_colour")
    use = None
    if trained:
        steps = [t.step for t in trained]
        step = b.selectbox("train step (a reused experience was trained several times)", steps, key="viewer_use")
        use = trained[steps.index(step)] if step in steps else trained[0]
        if use.logprobs is None:
            st.info(
                f"train step {use.step} computed no log-probs of its own (one update a step: the ratio is 1 without "
                "them): the trainer log-prob is none"
            )
    else:
        st.info("no train step recorded this experience (pending, dropped, or a DB from before schema version 5)")
    shown = tokens_html(token_rows(exp, use, tokenizer), quantity)
    st.html(f'<div class="exp-shown" data-exp-id="{int(exp.id)}">{shown}</div>')
    st.caption(
        "underlined: trained tokens (the mask); struck through: response tokens not trained; grey: the prompt. "
        "Advantages: red < 0 < green; log-probs: the bluer, the less likely. Hover a token for its numbers."
    )
    group_view(db, exp, quantity, tokenizer)


def group_view(db: ExpDB, exp, quantity: str, tokenizer) -> None:
    """The responses of the experience's group side by side, with their rewards (at most 4 a row)."""
    if not exp.group_id:
        return
    members = db.group(exp.group_id)
    st.subheader(f"Group {exp.group_id!r}: {len(members)} responses")
    for start in range(0, len(members), 4):
        for col, x in zip(st.columns(4), members[start : start + 4]):
            _, trained = db.experience(x.id)
            rows = [r for r in token_rows(x, trained[0] if trained else None, tokenizer) if r["part"] == "response"]
            mark = " (shown above)" if x.id == exp.id else ""
            col.markdown(f"**run {x.run_id}** · id {x.id} · reward **{x.reward}**{mark}")
            col.html(
                f'<div class="group-member" data-exp-id="{int(x.id)}" data-reward="{x.reward}">'
                f"{tokens_html(rows, quantity)}</div>"
            )


def show(db: ExpDB) -> None:
    """The page below the DB input: the token-text model, the filters, the table, the experience shown."""
    st.caption(f"{db.where}: schema version {db.version}, opened read-only")
    on_open(db)
    tokenizer = tokenizer_input(db)
    rows = table(db, filters_form(db))
    from_address("exp", "viewer_exp", int)
    if "viewer_exp" not in st.session_state and rows:
        st.session_state["viewer_exp"] = rows[0]["id"]
    exp_id = st.number_input("experience id (or select a row)", min_value=1, value=None, step=1, key="viewer_exp")
    in_address("exp", exp_id)
    if exp_id is not None:
        experience_view(db, int(exp_id), tokenizer)


# --- the page

st.title("Experiences")
from_address("db", "viewer_db")
where = st.text_input("experience DB: a SQLite path or a postgresql:// URL", key="viewer_db")
in_address("db", where)
if not where:
    st.info("Give an experience DB: a run's <job dir>/buffer/exp.db, or the URL of a PostgreSQL one.")
    st.stop()
try:
    db = ExpDB(where)
except (NotAnExperienceDB, DBReadError) as e:  # not an experience DB, or a damaged one: named
    st.error(str(e))
    st.stop()
with db:
    try:
        show(db)
    except DBReadError as e:  # a damaged file, a server gone: named on the page, not a traceback
        st.error(str(e))
