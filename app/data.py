"""Data for verl 0.9.1: `prep [gsm8k|arith]` writes GSM8K (and `arith`, additions a tiny model can learn) in
verl's RL and multi-turn SFT schemas; `data check FILE [--kind rl|sft] [--fix OUT]` checks (and repairs) users'
own parquet before a training run trips over it. The preflight of `sft`/`grpo-head` calls `check_parquet`,
`compare_splits` and `check_prompt_lengths`.
"""

from __future__ import annotations

import ast
import contextlib
import decimal
import functools
import gzip
import importlib.util
import json
import math
import re
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from app.common import (REPO_ROOT, ArgParser, UserError, atomic_path, file_problem, refuse_symlink_loop, resolved,
                        say, verl_dir, warn)
from app.settings import Settings, user_cache

GSM8K_DATA_SOURCE = "openai/gsm8k"  # the name verl's default scorer routes to its GSM8K scorer
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
BUNDLED_GSM8K = REPO_ROOT / "data" / "gsm8k_source"
SPLITS = ("train", "test")
KINDS = ("rl", "sft")
# Roles the chat templates of the models this stack trains (Qwen, Llama, ...) accept.
KNOWN_ROLES = ("system", "user", "assistant", "tool")
# What verl's gsm8k scorer can match after "#### " (its regex, less the commas we strip).
_NUMBER = re.compile(r"-?[0-9.]*[0-9][0-9.]*")


# --- checking ----------------------------------------------------------------------------------------
@dataclass
class CheckReport:
    """A file that passed `check_parquet`: its kind, rows, soft notes (not errors, e.g. a data_source that needs
    a custom reward function) and one hashable key per row (its chat) for the duplicate and overlap checks."""

    path: Path
    kind: str
    rows: int
    notes: list[str] = field(default_factory=list)
    keys: list = field(default_factory=list, repr=False)


def _verl_file(relative: str) -> Path | None:
    """A file of the installed verl package, located without importing verl."""
    package = verl_dir()
    return package / relative if package is not None and (package / relative).is_file() else None


@functools.cache
def routed_data_sources() -> tuple[frozenset[str], tuple[str, ...]] | None:
    """(names, prefixes) of the data_source values verl's `default_compute_score` routes to a scorer, or None
    without verl. Parsed from the installed verl's source, so the list follows its version. Not imported: that
    module imports verl, torch and Ray (11.5 s measured, against 6 ms to parse), and the names are literals in
    the function's body, not a list it exports."""
    path = _verl_file("utils/reward_score/__init__.py")
    if path is None:
        return None
    tree = ast.parse(path.read_text(encoding="utf-8"))
    func = next((node for node in tree.body if isinstance(node, ast.FunctionDef)
                 and node.name == "default_compute_score"), None)
    if func is None:
        return None

    def strings(nodes: list[ast.AST]) -> list[str]:
        return [n.value for node in nodes for n in ast.walk(node) if isinstance(n, ast.Constant)
                and isinstance(n.value, str)]

    names: set[str] = set()
    prefixes: list[str] = []
    for node in ast.walk(func):
        if isinstance(node, ast.Compare) and ast.unparse(node.left) == "data_source":
            names.update(strings(node.comparators))
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "data_source.startswith":
            prefixes += strings(node.args)
    return frozenset(names), tuple(prefixes)


def _read_table(path: Path, remedy: str = "rewrite it with pandas.DataFrame.to_parquet or pyarrow"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    refuse_symlink_loop(path)
    problem = file_problem(path)  # by stat: a FIFO is refused here, not opened (that would wait forever)
    if problem:
        todo = {"does not exist": "check the path (a parquet file with your rows)",
                "is a directory": "pass one parquet file"}.get(problem, "pass a parquet file")
        raise UserError(f"{path} {problem}: {todo}")
    try:
        # ParquetFile, not pq.read_table: read_table goes through pyarrow.dataset, whose import pulls in
        # pandas (~0.4 s of every preflight) for a single local file that needs neither
        with pq.ParquetFile(path) as parquet:
            return parquet.read()
    except (pa.ArrowException, OSError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{path} is not a readable parquet file ({reason}): {remedy}") from None


# The checks compare arrow arrays with arrow kernels only, and options rather than literals: turning a
# Python value into arrow (pa.scalar, pa.array, a literal in pc.equal) or arrow into numpy makes pyarrow
# import pandas, ~0.4 s of every preflight.
def _is_text(arrow_type) -> bool:
    import pyarrow as pa

    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)


def _is_list(arrow_type) -> bool:
    import pyarrow as pa

    return pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)


def _is_number_type(arrow_type) -> bool:
    import pyarrow as pa

    return pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type) or pa.types.is_decimal(arrow_type)


def _fields(arrow_type) -> set[str]:
    """The field names of a struct type; none for any other type."""
    import pyarrow as pa

    return {f.name for f in arrow_type} if pa.types.is_struct(arrow_type) else set()


def _first(mask) -> int | None:
    """Index of the first True in a boolean arrow array (nulls count as False), or None."""
    import pyarrow.compute as pc

    hits = pc.indices_nonzero(mask)
    return hits[0].as_py() if len(hits) else None


def _refuse_row(mask, where: str, problem: str, rows=None) -> None:
    """UserError `{where}: row N {problem}` for the first True in `mask`; `rows`: the row of each message."""
    i = _first(mask)
    if i is not None:
        raise UserError(f"{where}: row {rows[i].as_py() if rows is not None else i} {problem}")


def _is_empty(array):
    """True where a string or list arrow array holds null, "" or []."""
    import pyarrow as pa
    import pyarrow.compute as pc

    lengths = pc.list_value_length(array) if _is_list(array.type) else pc.binary_length(array)
    return pc.or_kleene(array.is_null(), pc.invert(pc.cast(lengths, pa.bool_())))


def _is_one_of(strings, names: Iterable[str]):
    """True where a string arrow array equals one of `names` exactly (null -> False)."""
    import pyarrow.compute as pc

    pattern = "^(?:" + "|".join(re.escape(name) for name in names) + ")$"  # RE2: $ is the very end
    return pc.and_kleene(strings.is_valid(), pc.match_substring_regex(strings, pattern=pattern))


def _check_chat(table, column: str, where: str, kind: str) -> tuple:
    """Check a chat column (RL `prompt`, SFT `messages`): list of {role, content}, known roles.
    Returns (roles, the row of each message) for the SFT check."""
    import pyarrow.compute as pc

    array = table.column(column).combine_chunks()
    if _is_text(array.type):
        preview = (array[0].as_py() or "")[:60]
        if kind == "rl":
            raise UserError(
                f"{where}: `{column}` is a plain string (row 0: {preview!r}); verl needs a chat list "
                f"[{{\"role\": \"user\", \"content\": ...}}] and fails mid-training otherwise: "
                f"run `python -m app data check {where} --fix OUT.parquet` and train on OUT.parquet")
        raise UserError(
            f"{where}: `{column}` is a plain string (row 0: {preview!r}); SFT needs a conversation "
            f"[{{\"role\": \"user\", ...}}, {{\"role\": \"assistant\", ...}}]: rebuild the column as such lists")
    if not _is_list(array.type):
        raise UserError(f"{where}: `{column}` has type {array.type}, not a list of {{role, content}} "
                        f"messages: rewrite it as [{{\"role\": \"user\", \"content\": ...}}, ...]")
    message_type = array.type.value_type
    if {"role", "content"} - _fields(message_type):
        raise UserError(f"{where}: the messages in `{column}` are {message_type}, not {{role, content}} "
                        f"dicts: rewrite each message as {{\"role\": ..., \"content\": ...}}")
    _refuse_row(array.is_null(), where, f"has no `{column}` (null): fill it or drop the row")
    _refuse_row(_is_empty(array), where,  # nulls are refused above: what is left is []
                f"has an empty `{column}` list: give it at least one message or drop the row")
    messages = array.flatten()
    parents = pc.list_parent_indices(array)
    _refuse_row(messages.is_null(), where, f"has a null message in `{column}`: remove it or make it {{role, content}}",
                parents)
    roles = messages.field("role")
    if not _is_text(roles.type):
        raise UserError(f"{where}: `{column}` roles have type {roles.type}, not text: use 'user', 'assistant', ...")
    if (i := _first(pc.invert(_is_one_of(roles, KNOWN_ROLES)))) is not None:
        raise UserError(f"{where}: row {parents[i].as_py()} has a message with role {roles[i].as_py()!r} in "
                        f"`{column}`, not one of {', '.join(KNOWN_ROLES)}: rename it (chat templates reject "
                        f"other roles; {'RL' if kind == 'rl' else 'SFT'} training would fail on it)")
    contents = messages.field("content")
    if _is_list(contents.type):
        raise UserError(f"{where}: the messages in `{column}` hold content parts ({contents.type}), not text; "
                        f"chat templates of text models need a string: run `python -m app data check {where} "
                        "--fix OUT.parquet` (joins text parts) and train on OUT.parquet")
    if not _is_text(contents.type):
        raise UserError(f"{where}: message content in `{column}` has type {contents.type}, not text: store "
                        "every message's content as a string")
    _refuse_row(contents.is_null(), where, f"has a message without content in `{column}`: give every message a "
                "text `content`", parents)
    return roles, parents


def _check_rl(table, where: str) -> list[str]:
    """Check RL columns beyond `prompt`; returns the notes (data_source values verl does not route)."""
    import pyarrow.compute as pc

    if "data_source" not in table.column_names:
        raise UserError(f"{where}: no `data_source` column: add one (e.g. \"{GSM8K_DATA_SOURCE}\"); verl picks "
                        "the reward function by it")
    if "reward_model" not in table.column_names:
        raise UserError(f"{where}: no `reward_model` column: add {{\"style\": \"rule\", \"ground_truth\": ...}} "
                        "to every row; the reward needs the ground truth")
    _check_chat(table, "prompt", where, "rl")

    source = table.column("data_source").combine_chunks()
    if not _is_text(source.type):
        raise UserError(f"{where}: `data_source` has type {source.type}, not text: store the dataset name "
                        "as a string")
    _refuse_row(_is_empty(source), where, "has an empty `data_source`: set it to the dataset name")

    reward = table.column("reward_model").combine_chunks()
    if "ground_truth" not in _fields(reward.type):
        raise UserError(f"{where}: `reward_model` is {reward.type}, not a dict with `ground_truth`: write "
                        "{\"style\": \"rule\", \"ground_truth\": ...} in every row")
    truth = reward.field("ground_truth")
    missing = pc.or_(reward.is_null(), _is_empty(truth) if _is_text(truth.type) else truth.is_null())
    _refuse_row(missing, where, "has no reward_model.ground_truth: fill it in or drop the row; without it the "
                "reward cannot be computed")
    if _is_number_type(truth.type):
        raise UserError(
            f"{where}: reward_model.ground_truth is stored as {truth.type} (row 0: {truth[0].as_py()!r}), not as "
            f"text: verl's scorers compare it with the extracted answer as a string, so every answer would score "
            f"0.0: run `python -m app data check {where} --fix OUT.parquet` (writes it as text) and train on "
            "OUT.parquet")

    routed = routed_data_sources()
    if routed is None:
        return ["verl is not installed here, so which data_source values its default scorer routes was not checked"]
    names, prefixes = routed
    counts = {v["values"]: v["counts"] for v in pc.value_counts(source).to_pylist()}
    return [f"data_source {name!r} ({count} rows) is not routed by verl's default scorer: configure a custom reward "
            f"function (reward.custom_reward_function.path=my_reward.py "
            f"reward.custom_reward_function.name=compute_score), or GRPO fails at the first reward"
            for name, count in sorted(counts.items()) if name not in names and not name.startswith(prefixes)]


def _check_sft(table, where: str) -> None:
    import pyarrow.compute as pc

    roles, parents = _check_chat(table, "messages", where, "sft")
    # rows that have an assistant message, ascending (parent indices never decrease)
    with_answer = pc.unique(pc.filter(parents, _is_one_of(roles, ["assistant"]))).to_pylist()
    if len(with_answer) < table.num_rows:
        row = next((i for i, r in enumerate(with_answer) if i != r), len(with_answer))
        raise UserError(f"{where}: row {row} has no assistant message: SFT learns only from assistant "
                        "turns; add the answer as {\"role\": \"assistant\", ...} or drop the row")


def is_prompt_response(columns) -> bool:
    """The old walkthrough's single-turn SFT form (verl < 0.7: data.prompt_key / data.response_key)."""
    columns = set(columns)
    return {"prompt", "response"} <= columns and "messages" not in columns and "reward_model" not in columns


def compare_splits(train: CheckReport, val: CheckReport) -> str | None:
    """Refuse a validation file that holds the training rows; a warning (returned) when some overlap."""
    if not train.keys or not val.keys or train.kind != val.kind:
        return None
    train_keys = set(train.keys)
    shared = sum(key in train_keys for key in val.keys)
    if shared == len(val.keys) and set(val.keys) == train_keys:
        raise UserError(f"{val.path} holds the same rows as {train.path}: validation on the training data "
                        "measures memorisation, not learning; point VAL_FILE (or the val file) at the held-out "
                        "split (make prep writes test.parquet beside train.parquet)")
    if shared:
        return (f"{shared} of {len(val.keys)} rows of {val.path} also appear in {train.path}: those validation "
                "scores are inflated; remove them from one of the files")
    return None


def check_table(table, kind: str | None, where: str) -> CheckReport:
    """Check an in-memory arrow table as `check_parquet` does (`where` names it in messages)."""
    if table.num_rows == 0:
        raise UserError(f"{where} has no rows: an empty dataset cannot train; point at a file with data")
    columns = set(table.column_names)
    if is_prompt_response(columns):  # would otherwise pass for RL data (it has `prompt`) or lack `messages`
        raise UserError(
            f"{where} is prompt/response SFT data (the old walkthrough's form: columns prompt + response); verl "
            f"0.9.1 trains SFT only on a `messages` conversation: convert it with `python -m app data check {where} "
            "--fix OUT.parquet` (make data-check FILE=... FIX=OUT.parquet) and train on OUT.parquet")
    if kind is None and not {"prompt", "messages"} & columns:
        raise UserError(f"{where} has neither a `prompt` column (RL) nor a `messages` column (SFT); "
                        f"columns: {', '.join(sorted(columns))}: rename the chat column")
    if kind is None:
        kind = "sft" if "prompt" not in columns else "rl"
    if kind not in KINDS:
        raise UserError(f"unknown kind {kind!r}: use rl or sft")
    needed = "prompt" if kind == "rl" else "messages"
    if needed not in columns:
        raise UserError(f"{where} has no `{needed}` column, which {kind.upper()} data needs; columns: "
                        f"{', '.join(sorted(columns))}: rename your chat column to `{needed}`")
    notes = _check_rl(table, where) if kind == "rl" else []
    if kind == "sft":
        _check_sft(table, where)
    # to_pylist, not arrow kernels on literals (those would import pandas, see above); 7.5k GSM8K rows: ~0.05 s
    keys = [tuple((m["role"], m["content"]) for m in chat) for chat in table.column(needed).to_pylist()]
    first = {key: row for row, key in reversed(list(enumerate(keys)))}  # each key's first row
    repeats = [(row, first[key]) for row, key in enumerate(keys) if first[key] != row]
    if repeats:
        notes.append(f"{where}: {len(repeats)} of {len(keys)} rows repeat an earlier row's "
                     f"{'prompt' if kind == 'rl' else 'conversation'} (first: row {repeats[0][0]} = row "
                     f"{repeats[0][1]}): duplicates count double in training and in validation; drop them (pandas: "
                     "drop_duplicates) unless that weighting is intended")
    return CheckReport(Path(where), kind, table.num_rows, notes, keys)


def check_parquet(path: Path | str, kind: str | None = None) -> CheckReport:
    """Check that verl 0.9.1 will accept `path` as RL (`kind="rl"`) or SFT (`"sft"`) data; `kind=None` infers
    it from the columns. Raises UserError (one actionable line) on the first problem; the report's `notes` hold
    soft findings, e.g. an RL data_source that verl's default scorer does not route."""
    path = Path(path)
    return check_table(_read_table(path), kind, str(path))


# apply_chat_template arguments that change how verl tokenizes (its tokenize=True path) or that clash with the
# count's own: where the user passes one, verl's filter decides
_TOKENIZING_KWARGS = {"add_generation_prompt", "truncation", "max_length", "padding", "tokenizer_kwargs",
                      "continue_final_message", "return_assistant_tokens_mask"}


def _selected(lengths: list[int], max_samples, shuffle: bool, seed) -> list[int]:
    """The rows verl's RLHFDataset keeps before its filter (data.train_max_samples / val_max_samples)."""
    if not max_samples or max_samples <= 0 or max_samples >= len(lengths):
        return lengths
    if not shuffle:
        return lengths[:max_samples]
    import numpy as np  # verl's own selection (rl_dataset.py), so that the same rows are counted

    rng = np.random.default_rng(*((seed,) if seed is not None else ()))
    return [lengths[i] for i in rng.choice(len(lengths), size=max_samples, replace=False).tolist()]


def check_prompt_lengths(spec, notes: list[str], warnings: list[str]) -> bool:
    """The RL prompts' tokens, counted with the tokenizer and chat template verl will use. verl 0.9.1 cuts the start
    of a prompt over rollout.prompt_length (agent_loop._cap_text_prompt_length): refused. Its filter drops rows
    over data.max_prompt_length: said; refused where less than a batch (or no val row) is left. True where the
    filter is on, every prompt fits and neither CONFIG nor ARGS set it: it can go (verl counts at every start)."""
    from omegaconf import OmegaConf

    from app.spec import FILTER_KEY

    sel, model = spec.get, spec.model_key
    limit = sel("data.max_prompt_length")
    cut_at = sel("actor_rollout_ref.rollout.prompt_length") or limit
    filtering = bool(sel(FILTER_KEY))
    template_kwargs = sel("data.apply_chat_template_kwargs")
    kwargs = OmegaConf.to_container(template_kwargs) if template_kwargs is not None else {}
    tokenizer_dir = Path(str(sel(f"{model}.tokenizer_path") or spec.model_path))
    skip = ("data.tool_config_path" if sel("data.tool_config_path") else
            "data.function_tool_path" if sel("data.function_tool_path") else
            "data.custom_cls.path" if sel("data.custom_cls.path") else
            "a multimodal processor" if (tokenizer_dir / "preprocessor_config.json").exists() else
            "data.apply_chat_template_kwargs" if _TOKENIZING_KWARGS & set(kwargs) else None)
    if skip:
        notes.append(f"prompt lengths: not counted ({skip} changes how verl counts): verl's filter decides")
        return False
    files = [("train", path) for path in spec.files("train")] + [("val", path) for path in spec.files("val")]
    template, trust = sel(f"{model}.custom_chat_template"), bool(sel(f"{model}.trust_remote_code"))
    tokenizer = tokenizer_loader(tokenizer_dir, trust, template)
    recipe = dict(prompt_key=sel("data.prompt_key") or "prompt", template_kwargs=kwargs, failed=limit + 1)
    counts: dict[str, list[int]] = {}
    try:
        for what, path in files:
            counts.setdefault(what, []).extend(
                cached_lengths(path, tokenizer_dir, tokenizer, {**recipe, "template": template, "trust": trust}, recipe))
    except Exception as exc:  # noqa: BLE001 - whatever a tokenizer raises, verl meets it too and says so itself
        reason = str(exc).splitlines()[0][:160] if str(exc) else ""
        warnings.append(f"prompt lengths not counted ({type(exc).__name__}: {reason}): "
                        f"verl's filter ({FILTER_KEY}={filtering}) decides")
        return False
    shuffle, seed = bool(sel("data.shuffle")), sel("data.seed")
    counts = {what: _selected(lengths, sel(f"data.{what}_max_samples"), shuffle, seed)
              for what, lengths in counts.items()}
    longest = max(max(lengths, default=0) for lengths in counts.values())
    kept = {what: [n for n in lengths if n <= limit] if filtering else lengths for what, lengths in counts.items()}
    cut = ", ".join(f"{sum(n > cut_at for n in lengths)} of {len(lengths)} {what}" for what, lengths in kept.items()
                    if any(n > cut_at for n in lengths))
    if cut:
        drop = "" if filtering else f" or ARGS='{FILTER_KEY}=True' to drop them"
        raise UserError(f"{cut} prompts are longer than actor_rollout_ref.rollout.prompt_length={cut_at} (longest "
                        f"{longest} tokens){'' if filtering else f' and {FILTER_KEY} is off'}: verl 0.9.1 would cut "
                        f"off their beginnings; raise data.max_prompt_length (and rollout.prompt_length where set) "
                        f"to {longest}{drop}")
    batch = sel("data.train_batch_size")
    dropped = {what: len(counts[what]) - len(kept[what]) for what in counts}
    short = "train" if len(kept["train"]) < batch else "val" if "val" in kept and not kept["val"] else None
    if short:
        left = len(kept[short])
        why = (f"verl's length filter would leave {left} {short} prompts (data.max_prompt_length={limit}, "
               f"longest {longest} tokens)" if dropped[short] else f"{left} {short} prompts")
        if short == "train":
            why += (f", fewer than data.train_batch_size={batch}: verl drops the last partial batch, so no step "
                    "would run")
        todo = (f"raise data.max_prompt_length to {longest}" if dropped[short] else
                f"use more rows or a smaller batch, e.g. ARGS='data.train_batch_size={max(1, left)}'")
        raise UserError(f"{why}; {todo}")
    if not any(dropped.values()):
        summary = " and ".join(f"{len(lengths)} {what}" for what, lengths in counts.items())
        note = f"prompt lengths: longest {longest} tokens of {summary} prompts, within data.max_prompt_length={limit}"
        user = {o.lstrip("+").split("=", 1)[0] for o in spec.args} | set(spec.settings.config or {})
        if filtering and FILTER_KEY not in user:
            notes.append(f"{note}: verl's length filter at every start skipped ({FILTER_KEY}=False)")
            return True
        notes.append(note)
        return False
    gone = ", ".join(f"{n} of {len(counts[what])} {what}" for what, n in dropped.items() if n)
    warnings.append(f"{gone} prompts are longer than data.max_prompt_length={limit} (longest {longest} tokens): "
                    f"verl's filter drops them at start; raise data.max_prompt_length to keep them")
    return False


def prompt_lengths(path: Path | str, tokenizer, prompt_key: str = "prompt", template_kwargs: dict | None = None,
                   chunk: int = 4096, failed: int | None = None, generation_prompt: bool = True) -> list[int]:
    """Each row's prompt length in tokens as verl 0.9.1's RLHFDataset counts it for its length filter: the chat
    template with the generation prompt, tokenized without special tokens. verl counts row by row (in
    `datasets.filter`, one process by default) at every start; a fast tokenizer encodes a chunk in one call. A
    failed chunk is counted row by row; a row whose template fails counts as `failed` (verl: max_prompt_length + 1)."""
    import pyarrow.parquet as pq

    skipped = ("tokenize", "return_dict", "return_tensors")
    kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in skipped}

    def count(rows: list) -> list[int]:
        texts = tokenizer.apply_chat_template(rows, add_generation_prompt=generation_prompt, tokenize=False, **kwargs)
        encoded = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)
        return [len(ids) for ids in encoded["input_ids"]]

    with pq.ParquetFile(path) as parquet:
        rows = parquet.read(columns=[prompt_key]).column(prompt_key).to_pylist()
    lengths: list[int] = []
    for start in range(0, len(rows), chunk):
        part = rows[start:start + chunk]
        try:
            lengths += count(part)
        except Exception:  # noqa: BLE001 - a template's raise_exception, a row it cannot render: as verl, per row
            if failed is None:
                raise
            for row in part:
                try:
                    lengths += count([row])
                except Exception:  # noqa: BLE001
                    lengths.append(failed)
    return lengths


def tokenizer_loader(tokenizer_dir: Path, trust: bool = False, template: str | None = None) -> Callable:
    """The tokenizer verl will load, loaded on the first call only (a cached count needs none: no transformers import)."""

    @functools.cache
    def load():
        from transformers import AutoTokenizer

        loaded = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=trust)
        if template:
            loaded.chat_template = template
        return loaded

    return load


# what a model directory holds besides its tokenizer: not read for the cache's key
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".onnx")


def cached_lengths(path: Path, tokenizer_dir: Path, tokenizer: Callable, key: dict, recipe: dict) -> list[int]:
    """prompt_lengths(path, tokenizer(), **recipe), kept per user under ~/.cache/verl-stack/lengths: importing
    transformers and tokenizing are most of a preflight (docs/benchmarks.md), and every launch counts the same
    files again. The key is the data file's bytes, every tokenizer file's (weights aside), `key` and the
    tokenizer libraries' versions: any change counts anew. A cache that cannot be read or written is skipped."""
    import hashlib
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "-"

    digest = hashlib.sha256(json.dumps([key, installed("transformers"), installed("tokenizers")], sort_keys=True,
                                       default=str).encode())
    try:
        files = [Path(path), *sorted(f for f in tokenizer_dir.iterdir() if f.is_file() and f.suffix not in _WEIGHTS)]
        for file in files:
            digest.update(f"{file.name}\0{file.stat().st_size}\0".encode())
            with open(file, "rb") as handle:
                digest.update(hashlib.file_digest(handle, "sha256").digest())
    except OSError:
        return prompt_lengths(path, tokenizer(), **recipe)  # verl meets the unreadable file and says so
    cache = user_cache() / "verl-stack" / "lengths" / f"{digest.hexdigest()}.json"
    with contextlib.suppress(OSError, ValueError):
        lengths = json.loads(cache.read_text())
        if isinstance(lengths, list) and all(type(n) is int for n in lengths):
            return lengths
    lengths = prompt_lengths(path, tokenizer(), **recipe)
    with contextlib.suppress(OSError, UserError):  # UserError: atomic_path's unwritable directory or full disk
        cache.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(cache) as tmp:
            tmp.write_text(json.dumps(lengths))
    return lengths


def check_run_data(spec, notes: list[str], warnings: list[str]) -> None:
    """The run's data files (app.spec's composed config) as verl will meet them: each one readable in the job's
    schema, val apart from train, a batch of rows at least (verl drops the last partial batch: SFT then divides by
    zero, GRPO asserts an empty loader). Their lengths: check_sft_lengths, check_prompt_lengths."""
    kind = "sft" if spec.job == "sft" else "rl"
    reports = {}
    for split in ("train", "val"):
        for path in spec.files(split):
            if not path.exists():
                raise UserError(f"{split} file {path} does not exist: run `make prep` (DATA_DIR={path.parent.parent}) "
                                f"or set {'TRAIN_FILE' if split == 'train' else 'VAL_FILE'} to your parquet")
            report = reports[path] = check_parquet(path, kind)
            notes.append(f"{split} file: {path} ({report.rows} rows, {kind})")
            warnings += list(report.notes)
    train, val = spec.files("train"), spec.files("val")
    warnings += [overlap for t in train for v in val if (overlap := compare_splits(reports[t], reports[v]))]
    if spec.job == "sft":
        if not val:
            warnings.append("no validation file: SFT runs without val/loss (VAL_FILE, or DATA_DIR's test.parquet)")
    elif not val:
        raise UserError("data.val_files is empty, but verl 0.9.1's GRPO always builds its val dataset: keep a val "
                        "file (VAL_FILE, or DATA_DIR's test.parquet)")
    rows, batch = sum(reports[p].rows for p in train), spec.get("data.train_batch_size")
    if rows < batch:
        raise UserError(f"{rows} train rows, fewer than data.train_batch_size={batch}: no step would run; use more "
                        f"rows or a smaller batch, e.g. ARGS='data.train_batch_size={rows}'")


def check_sft_lengths(spec, files: list[Path], warnings: list[str]) -> None:
    """SFT conversations against data.max_length, counted with the chat template verl's SFT dataset uses: verl cuts
    a longer one where data.truncation says (the profile: right, its answer off) or stops the run (error). Refused
    where verl would stop, said where it would cut: never cut silently."""
    limit, mode = spec.get("data.max_length"), spec.get("data.truncation")
    tokenizer_dir = Path(str(spec.get(f"{spec.model_key}.tokenizer_path") or spec.model_path))
    tokenizer = tokenizer_loader(tokenizer_dir)
    recipe = dict(prompt_key=spec.get("data.messages_key") or "messages", failed=0, generation_prompt=False)
    try:
        lengths = [n for path in files for n in cached_lengths(path, tokenizer_dir, tokenizer, recipe, recipe)]
    except Exception as exc:  # noqa: BLE001 - whatever a tokenizer raises, verl meets it too and says so itself
        warnings.append(f"SFT lengths not counted ({type(exc).__name__}): verl's data.truncation={mode} decides")
        return
    over = [n for n in lengths if n > limit]
    if not over:
        return
    said = f"{len(over)} of {len(lengths)} train conversations are longer than data.max_length={limit} " \
           f"(longest {max(over)} tokens)"
    if mode == "error":
        raise UserError(f"{said}: verl would stop at the first (data.truncation=error); raise data.max_length to "
                        f"{max(over)}")
    warnings.append(f"{said}: verl cuts them ({'their ends, answers included' if mode == 'right' else 'their starts'}: "
                    f"data.truncation={mode}); raise data.max_length to {max(over)}, or data.truncation=error to refuse")


def _text_of_parts(content, where: str):
    """Content parts ([{"type": "text", "text": ...}, ...], the OpenAI form) as one text, back to back as the chat
    templates that accept parts render them; anything else as it is. A part that is not text is refused."""
    if not isinstance(content, (list, tuple)):
        return content
    texts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = repr(part.get("type")) if isinstance(part, dict) else type(part).__name__
            raise UserError(f"{where} has a content part of type {kind}, not text: --fix joins text parts only (this "
                            "stack trains text models); drop that part or write it as text")
        texts.append(part["text"])
    return "".join(texts)


def _chat_from_string(text: str | None, where: str) -> list[dict] | None:
    """A string prompt as a chat list: a JSON-encoded chat list is decoded (not wrapped as text), plain text
    becomes one user message."""
    if text is None:
        return None
    stripped = text.strip()
    if stripped.startswith("["):
        with contextlib.suppress(ValueError):
            decoded = json.loads(stripped)
            if isinstance(decoded, list) and decoded and all(
                    isinstance(m, dict) and {"role", "content"} <= set(m) for m in decoded):
                return [{"role": str(m["role"]), "content": _text_of_parts(m["content"], where)} for m in decoded]
    return [{"role": "user", "content": text}]


def _retyped(table, column: str, rows: list, arrow_type):
    """`table` with `column` replaced by `rows` of `arrow_type`. pandas and `datasets` trust the types they
    recorded in the schema metadata over the data (pandas then fails to read the file), so pandas' entry is
    updated and `datasets`' feature list dropped (it re-infers it from the arrow schema)."""
    import pyarrow as pa

    index = table.column_names.index(column)
    table = table.set_column(index, pa.field(column, arrow_type), pa.array(rows, type=arrow_type))
    metadata = dict(table.schema.metadata or {})
    metadata.pop(b"huggingface", None)
    if b"pandas" in metadata:
        pandas_meta = json.loads(metadata[b"pandas"])
        for entry in pandas_meta.get("columns", []):
            if entry.get("name") == column:
                entry.update(pandas_type="list[object]", numpy_type="object")
        metadata[b"pandas"] = json.dumps(pandas_meta).encode()
    return table.replace_schema_metadata(metadata or None)


def _join_parts(table, column: str, where: str, changes: list[str]):
    """`table` with the content parts of every message in chat column `column` joined into one text."""
    import pyarrow as pa

    chat_type = table.schema.field(column).type
    if not (_is_list(chat_type) and "content" in _fields(chat_type.value_type)
            and _is_list(chat_type.value_type.field("content").type)):
        return table
    chats = table.column(column).to_pylist()
    for row, chat in enumerate(chats):
        for message in chat or []:
            if message is not None:
                message["content"] = _text_of_parts(message["content"], f"{where} row {row}")
    message_type = pa.struct([pa.field("content", pa.string()) if f.name == "content" else f
                              for f in chat_type.value_type])
    changes.append(f"content parts of `{column}` joined into text in {len(chats)} rows")
    return _retyped(table, column, chats, pa.list_(message_type))


def _truth_as_text(value) -> str | None:
    """A numeric ground truth as the text verl's scorers compare with: 5 and 5.0 -> "5", 2.5 -> "2.5"."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None  # NaN is pandas' missing value: "nan" would pass as text and match no answer
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, decimal.Decimal):
        return format(value.normalize(), "f")
    return str(value)


def _fix_ground_truth(table, changes: list[str]):
    import pyarrow as pa

    if "reward_model" not in table.column_names:
        return table
    reward = table.schema.field("reward_model").type
    if "ground_truth" not in _fields(reward) or not _is_number_type(reward.field("ground_truth").type):
        return table
    rows = table.column("reward_model").to_pylist()
    for row in rows:
        if row is not None:
            row["ground_truth"] = _truth_as_text(row["ground_truth"])
    changes.append(f"reward_model.ground_truth written as text (was {reward.field('ground_truth').type})")
    fields = [pa.field("ground_truth", pa.string()) if f.name == "ground_truth" else f for f in reward]
    return _retyped(table, "reward_model", rows, pa.struct(fields))


def _prompt_response_to_messages(table, where: str, changes: list[str]):
    """prompt (text or chat list) + response (text) -> one `messages` conversation per row."""
    import pyarrow as pa

    conversations = []
    numbers = 0
    rows = zip(table.column("prompt").to_pylist(), table.column("response").to_pylist())
    for row, (prompt, response) in enumerate(rows):
        at = f"{where} row {row}"
        if not prompt:  # an assistant turn alone would pass as a conversation and train on no question
            raise UserError(f"{at} has no prompt: fill it in or drop the row")
        if isinstance(prompt, str):
            chat = _chat_from_string(prompt, at)
        elif isinstance(prompt, list):
            chat = [{"role": m.get("role"), "content": _text_of_parts(m.get("content"), at)}
                    for m in prompt if isinstance(m, dict)]
        else:
            raise UserError(f"{at}: `prompt` is a {type(prompt).__name__}, not text or a chat list: rewrite it as text")
        if isinstance(response, (int, float, decimal.Decimal)) and not isinstance(response, bool):
            # a number is its text, as a ground truth is: 5 and 5.0 -> "5" (pandas makes 5 a float beside a NaN)
            response, numbers = _truth_as_text(response), numbers + 1
        elif response is not None and not isinstance(response, str):
            raise UserError(f"{at}: `response` is a {type(response).__name__} ({str(response)[:40]!r}), not text: "
                            "write the answer as text")
        conversations.append(chat + [{"role": "assistant", "content": response}])
    changes.append(f"prompt + response converted to a `messages` conversation in {len(conversations)} rows")
    if numbers:
        changes.append(f"{numbers} numeric responses written as text (was {table.schema.field('response').type})")
    chat_type = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    table = table.select([c for c in table.column_names if c not in ("prompt", "response", "__index_level_0__")])
    table = table.add_column(0, pa.field("messages", chat_type), pa.array(conversations, type=chat_type))
    # pandas' and datasets' recorded column lists no longer match the file: drop them, both re-infer
    return table.replace_schema_metadata(None)


def fix_parquet(path: Path | str, out: Path | str, kind: str | None = None, force: bool = False
                ) -> tuple[CheckReport, list[str]]:
    """Write a repaired copy of `path` to `out`: RL string prompts as chat lists and a numeric ground truth as
    text, content parts joined into text, old prompt/response SFT as a `messages` conversation. The result is
    checked before it is written (atomically). Returns (report of the new file, one phrase per repair)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, out = Path(path), Path(out)
    if resolved(out, "FIX") == resolved(path, "FILE"):
        raise UserError(f"--fix {out} is the input file: write the fixed copy to a new path")
    if out.is_dir():
        raise UserError(f"FIX={out} is a directory: name the file to write, e.g. "
                        f"FIX={out / (path.stem + '.fixed.parquet')}")
    if out.exists() and not force:
        raise UserError(f"{out} already exists: choose another path or set FORCE=1 to replace it")
    table = _read_table(path)
    columns = table.column_names
    changes: list[str] = []
    if is_prompt_response(columns) and kind in (None, "sft"):
        table = _prompt_response_to_messages(table, str(path), changes)
        kind = "sft"
    elif kind == "sft" or (kind is None and "messages" in columns and "prompt" not in columns):
        table = _join_parts(table, "messages", str(path), changes)
        if not changes:
            raise UserError(f"--fix repairs RL data, prompt/response SFT data and content parts; {path} is `messages` "
                            "SFT data, which must already be a conversation list: `data check` says what is wrong "
                            "with it")
    else:
        if "prompt" in columns and _is_text(table.schema.field("prompt").type):
            chats = [_chat_from_string(text, f"{path} row {row}")
                     for row, text in enumerate(table.column("prompt").to_pylist())]
            table = _retyped(table, "prompt", chats, pa.list_(pa.struct([("role", pa.string()),
                                                                           ("content", pa.string())])))
            changes.append(f"{sum(chat is not None for chat in chats)} string prompts rewritten as chat lists")
        elif "prompt" in columns:
            table = _join_parts(table, "prompt", str(path), changes)
        table = _fix_ground_truth(table, changes)
        kind = "rl"
    report = check_table(table, kind, str(path))  # under the input's name: what is left wrong is its
    report.path = out
    with atomic_path(out, "FIX") as tmp:
        pq.write_table(table, tmp)
    return report, changes


# --- GSM8K ---------------------------------------------------------------------------------------------
@functools.cache
def verl_gsm8k_module():
    """verl's own `verl.utils.reward_score.gsm8k` module (what GRPO rewards with), or None without verl. Loaded
    from its file alone: importing verl pulls in torch and Ray (~10 s) for one self-contained regex module."""
    loaded = sys.modules.get("verl.utils.reward_score.gsm8k")
    if loaded is not None:
        return loaded
    path = _verl_file("utils/reward_score/gsm8k.py")
    if path is None:
        return None
    spec = importlib.util.spec_from_file_location("_verl_gsm8k_scorer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def verl_gsm8k_scorer() -> Callable[[str, str], float] | None:
    """verl's `compute_score(solution_str, ground_truth)` for GSM8K, or None without verl."""
    module = verl_gsm8k_module()
    return module.compute_score if module is not None else None


def _source_files(directory: Path, split: str) -> list[Path]:
    """The file(s) holding `split` in a GSM8K_SOURCE directory; one form only, to avoid guessing."""
    forms = [[directory / f"{split}.jsonl"], [directory / f"{split}.jsonl.gz"], [directory / f"{split}.parquet"],
             # a local copy of the Hugging Face dataset repository (openai/gsm8k) keeps shards in main/
             sorted(directory.glob(f"{split}-*.parquet")), sorted(directory.glob(f"main/{split}-*.parquet"))]
    found = [paths for paths in forms if paths and all(p.is_file() for p in paths)]
    odd = next((p for paths in forms for p in paths if p.exists() and not p.is_file()), None)
    if not found and odd is not None:  # a FIFO would block the read, a directory fail it
        raise UserError(f"{odd} {file_problem(odd)}: put GSM8K's {split} split there as a file")
    if not found:
        raise UserError(f"{directory} has no {split}.jsonl, {split}.jsonl.gz or {split}.parquet: put GSM8K's "
                        f"{split} split there (columns question, answer), or unset GSM8K_SOURCE for the bundled copy")
    if len(found) > 1:
        names = ", ".join(p.name for paths in found for p in paths[:1])
        raise UserError(f"{directory} holds {split} in several forms ({names}): keep one")
    return found[0]


def _read_jsonl(path: Path) -> list[tuple[str, dict]]:
    rows = []
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append((f"{path} line {number}", json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise UserError(f"{path} line {number} is not valid JSON ({exc.msg}): fix or remove that "
                                    "line (one JSON object per line)") from None
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as exc:
        raise UserError(f"{path} cannot be read ({type(exc).__name__}: {exc}): replace it with an intact "
                        "copy") from None
    return rows


def _read_parquet_rows(paths: list[Path]) -> list[tuple[str, dict]]:
    rows = []
    for path in paths:
        table = _read_table(path, "replace it with an intact copy")
        missing = {"question", "answer"} - set(table.column_names)
        if missing:
            raise UserError(f"{path} lacks column(s) {', '.join(sorted(missing))}: GSM8K needs `question` and "
                            "`answer`")
        questions = table.select(["question", "answer"]).to_pylist()
        rows += [(f"{path} row {number}", row) for number, row in enumerate(questions)]
    return rows


def _read_source(source: str | None) -> tuple[str, dict[str, list[tuple[str, dict]]]]:
    """(description, {split: [(where, {question, answer})]}) from GSM8K_SOURCE."""
    if source == "hf":
        try:
            import datasets

            loaded = datasets.load_dataset("openai/gsm8k", "main")
            return "openai/gsm8k (Hugging Face hub)", {
                split: [(f"openai/gsm8k {split} row {i}", row) for i, row in enumerate(loaded[split].to_list())]
                for split in SPLITS}
        except Exception as exc:  # network, auth, cache: all mean the same thing to the user
            reason = (str(exc).splitlines() or [""])[0][:120]
            raise UserError(f"could not load openai/gsm8k from the Hugging Face hub ({type(exc).__name__}: {reason}): "
                            "offline, unset GSM8K_SOURCE to use the bundled copy or point it at a directory "
                            "with train.jsonl/test.jsonl") from None
    directory = Path(source) if source else BUNDLED_GSM8K
    refuse_symlink_loop(directory, "GSM8K_SOURCE")
    if not directory.exists():
        raise UserError(f"GSM8K_SOURCE={source} does not exist: point it at a directory with train.jsonl and "
                        "test.jsonl (or .jsonl.gz/.parquet), set it to hf, or unset it for the bundled copy")
    if not directory.is_dir():
        raise UserError(f"GSM8K_SOURCE={source} is a file: point it at the directory that holds train and test")
    splits = {}
    for split in SPLITS:
        files = _source_files(directory, split)
        rows = _read_parquet_rows(files) if files[0].suffix == ".parquet" else _read_jsonl(files[0])
        if not rows:
            raise UserError(f"{files[0]} has no rows: an empty {split} split cannot be prepared; use a "
                            "complete copy of GSM8K")
        splits[split] = rows
    return ("bundled copy " if not source else "") + str(directory), splits


def gsm8k_ground_truth(answer: str) -> str | None:
    """The number after the last '####' of a GSM8K answer, commas removed; None if there is none."""
    if "####" not in answer:
        return None
    truth = answer.rsplit("####", 1)[1].strip().replace(",", "")
    return truth if _NUMBER.fullmatch(truth) else None


def _convert(split: str, rows: list[tuple[str, dict]], scorer, tick: Callable[[], object] = lambda: None
             ) -> tuple[list[dict], list[dict]]:
    """GSM8K rows of one split -> (RL rows, SFT rows); a bad row is refused, naming it."""
    rl_rows, sft_rows = [], []
    for index, (where, row) in enumerate(rows):
        if not isinstance(row, dict):
            raise UserError(f"{where} is not a JSON object: each line needs {{\"question\": ..., \"answer\": ...}}")
        question, answer = row.get("question"), row.get("answer")
        for name, value in (("question", question), ("answer", answer)):
            if not isinstance(value, str) or not value.strip():
                raise UserError(f"{where} has no text `{name}`: fix or remove that row")
        truth = gsm8k_ground_truth(answer)
        if truth is None:
            raise UserError(f"{where}: the answer does not end with '#### <number>': fix or remove that row "
                            f"(answer ends {answer[-40:]!r})")
        if scorer is not None and scorer(answer, truth) != 1.0:
            raise UserError(f"{where}: verl's gsm8k scorer gives the reference answer 0 against its own ground "
                            f"truth {truth!r} (it needs '#### <number>' with one space, near the end): fix that row")
        user = {"role": "user", "content": f"{question} {INSTRUCTION}"}
        extra = {"split": split, "index": index, "answer": answer, "question": question}
        rl_rows.append({"data_source": GSM8K_DATA_SOURCE, "prompt": [user], "ability": "math",
                        "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": extra})
        sft_rows.append({"messages": [user, {"role": "assistant", "content": answer}], "extra_info": extra})
        tick()
    return rl_rows, sft_rows


def _drop_repeats(split: str, rows: list[tuple[str, dict]], described: str) -> list[tuple[str, dict]]:
    """`rows` without exact repeats (the first is kept), with a warning: a repeat only doubles a row's weight, and
    refusing would make the user edit a downloaded dataset by hand. The same question with another answer is
    refused: which is the ground truth is the user's call (prep writes one RL prompt per question)."""
    first: dict[str, tuple[str, object]] = {}
    kept, dropped = [], []
    for where, row in rows:
        question = row.get("question") if isinstance(row, dict) else None
        if not isinstance(question, str):  # _convert refuses it, with its own line
            kept.append((where, row))
            continue
        if question in first:
            earlier, answer = first[question]
            if row.get("answer") != answer:
                raise UserError(f"{where} asks the same question as {earlier} with a different answer: keep the "
                                "right one and remove the other (prep writes one RL prompt per question)")
            dropped.append((where, earlier))
            continue
        first[question] = (where, row.get("answer"))
        kept.append((where, row))
    if dropped:
        where, earlier = dropped[0]
        warn(f"dropped {len(dropped)} repeated rows of the {split} split of {described} (the same question and "
             f"answer as an earlier row, first: {where} = {earlier}); {len(kept)} rows are prepared")
    return kept


def _refuse_test_in_train(splits: dict[str, list[tuple[str, dict]]], described: str) -> None:
    """A test split (validation, make eval) that is all train questions is refused before anything is written;
    a partial overlap is a warning, as in data check."""
    train = {row["question"]: where for where, row in splits.get("train", [])
             if isinstance(row, dict) and isinstance(row.get("question"), str)}
    test = [(where, row["question"]) for where, row in splits.get("test", [])
            if isinstance(row, dict) and isinstance(row.get("question"), str)]
    shared = [(where, train[question]) for where, question in test if question in train]
    if not shared:
        return
    if len(shared) == len(test):
        raise UserError(f"every question of the test split of {described} is also in its train split (first: "
                        f"{shared[0][0]} = {shared[0][1]}): validation and make eval would measure memorisation "
                        "(make check refuses a val file that repeats the train file); give GSM8K_SOURCE a held-out "
                        "test split")
    warn(f"{len(shared)} of {len(test)} test questions of {described} are also in its train split (first: "
         f"{shared[0][0]} = {shared[0][1]}): their validation and eval scores are inflated; remove them from one "
         "split")


def write_splits(data_dir: Path, name: str, converted: dict[str, tuple[list[dict], list[dict]]],
                 headline: str) -> dict[str, Path]:
    """Write `<data_dir>/<name>/{split}.parquet` (RL) and `<data_dir>/<name>_sft/{split}.parquet` (SFT messages)
    for every split of `converted` ({split: (rl_rows, sft_rows)}), all files or none: each is checked with
    `check_parquet` before the set is renamed into place (RL and SFT rows agree by construction: `_convert` builds
    both from one user message and one extra_info). Then says `headline` and them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    # the files' format, declared: what verl reads does not depend on the rows' key order
    message = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    extra = pa.struct([("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()),
                       ("question", pa.string())])
    rl_schema = pa.schema([("data_source", pa.string()), ("prompt", message), ("ability", pa.string()),
                           ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
                           ("extra_info", extra)])
    sft_schema = pa.schema([("messages", message), ("extra_info", extra)])
    outputs = {f"{sub}/{split}": data_dir / sub / f"{split}.parquet"
               for sub in (name, f"{name}_sft") for split in converted}
    new_dirs = [d for d in (data_dir, data_dir / name, data_dir / f"{name}_sft") if not d.exists()]
    try:
        with contextlib.ExitStack() as stack:
            for split, (rl_rows, sft_rows) in converted.items():
                rl_tmp = stack.enter_context(atomic_path(outputs[f"{name}/{split}"], "DATA_DIR"))
                sft_tmp = stack.enter_context(atomic_path(outputs[f"{name}_sft/{split}"], "DATA_DIR"))
                pq.write_table(pa.Table.from_pylist(rl_rows, schema=rl_schema), rl_tmp)
                pq.write_table(pa.Table.from_pylist(sft_rows, schema=sft_schema), sft_tmp)
                for tmp, kind in ((rl_tmp, "rl"), (sft_tmp, "sft")):
                    report = check_parquet(tmp, kind)
                    if report.notes or report.rows != len(rl_rows):
                        raise RuntimeError(f"prep self-check of {split} {kind}: {report.rows} rows, {report.notes}")
    except BaseException:
        for directory in reversed(new_dirs):  # leave DATA_DIR as it was: drop directories made for this run
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise
    say(headline)
    for key, path in outputs.items():
        sub, split = key.split("/")
        kind = "SFT messages" if sub.endswith("_sft") else "RL prompt"
        say(f"wrote {path} ({len(converted[split][0])} rows, {kind})")
    return outputs


_SCORED = ", verl's gsm8k scorer gives every reference answer 1.0"


def prep_gsm8k(source: str | None = None, data_dir: Path | str = "data") -> dict[str, Path]:
    """Prepare GSM8K for verl 0.9.1: {"gsm8k/train": path, "gsm8k/test", "gsm8k_sft/train", "gsm8k_sft/test"}.
    `source`: None (the copy bundled in the repo), a directory with train/test as .jsonl, .jsonl.gz or .parquet
    (columns question, answer), or "hf" (openai/gsm8k through `datasets`). Every row is validated, and verl's
    gsm8k scorer must give its reference answer 1.0, before anything is written."""
    from tqdm import tqdm

    described, splits = _read_source(source)
    splits = {split: _drop_repeats(split, rows, described) for split, rows in splits.items()}
    _refuse_test_in_train(splits, described)
    scorer = verl_gsm8k_scorer()
    if scorer is None:
        warn("verl is not installed: the reference answers were not scored with verl's gsm8k scorer")
    # disable=None: a bar on a terminal, nothing in logs (so a failure stays one line there)
    with tqdm(total=sum(len(rows) for rows in splits.values()), desc="gsm8k", unit="row", disable=None) as bar:
        converted = {split: _convert(split, rows, scorer, bar.update) for split, rows in splits.items()}
    return write_splits(Path(data_dir), "gsm8k", converted, f"GSM8K from {described}" + (_SCORED if scorer else ""))


# --- arith: a task a tiny model learns in minutes (the proof that SFT and GRPO make a model better) ------
# Two-number addition asked in GSM8K's form (question + INSTRUCTION, answer `#### <sum>`), so the GSM8K
# pipeline, verl's gsm8k scorer (data_source openai/gsm8k) and `make eval` apply unchanged. The pairs are
# fixed by a seed and split disjointly: every test question is unseen in training.
ARITH_MAX = 100  # operands 0..99
ARITH_TEST_ROWS = 1000
ARITH_SEED = 0


def prep_arith(data_dir: Path | str = "data") -> dict[str, Path]:
    """Write the addition task as `<data_dir>/arith/{train,test}.parquet` (RL) and `arith_sft/` (SFT)."""
    import random

    scorer = verl_gsm8k_scorer()
    pairs = [(a, b) for a in range(ARITH_MAX) for b in range(ARITH_MAX)]
    random.Random(ARITH_SEED).shuffle(pairs)
    converted = {}
    for split, chosen in (("train", pairs[ARITH_TEST_ROWS:]), ("test", pairs[:ARITH_TEST_ROWS])):
        rows = [(f"arith {split} row {i}", {"question": f"What is {a} + {b}?", "answer": f"#### {a + b}"})
                for i, (a, b) in enumerate(chosen)]
        converted[split] = _convert(split, rows, scorer)
    headline = f"arith: {ARITH_MAX}x{ARITH_MAX} additions, {ARITH_TEST_ROWS} held out for test"
    return write_splits(Path(data_dir), "arith", converted, headline + (_SCORED if scorer else ""))


# --- CLI -----------------------------------------------------------------------------------------------
def main(command: str, argv: list[str], settings: Settings) -> int:
    if command == "prep":
        parser = ArgParser(prog="python -m app prep", description="Prepare datasets for verl: GSM8K and the "
                           "arith task (default: both).")
        parser.add_argument("dataset", nargs="?", default="all", choices=["all", "gsm8k", "arith"])
        parser.add_argument("--source", default=settings["GSM8K_SOURCE"],
                            help="directory with train/test .jsonl[.gz]/.parquet, or hf (default: GSM8K_SOURCE, "
                                 "else the bundled copy)")
        parser.add_argument("--data-dir", default=settings["DATA_DIR"], help="output root (default: DATA_DIR or data)")
        args = parser.parse_args(argv)
        if args.dataset in ("all", "gsm8k"):
            prep_gsm8k(args.source, args.data_dir)
        if args.dataset in ("all", "arith"):
            prep_arith(args.data_dir)
        return 0

    parser = ArgParser(prog="python -m app data", description="Check (and fix) your own parquet for verl.")
    parser.add_argument("action", choices=["check"])
    # make data-check FILE=... KIND=... FIX=...: the Makefile passes them as settings, not arguments
    parser.add_argument("file", type=Path, nargs="?" if settings["FILE"] else None, default=settings["FILE"],
                        help="the parquet to check (FILE)")
    parser.add_argument("--kind", choices=KINDS, default=settings["KIND"],
                        help="rl or sft (KIND; default: from the columns)")
    parser.add_argument("--fix", type=Path, metavar="OUT", default=settings["FIX"],
                        help="write a repaired copy to OUT (FIX): string prompts -> chat lists, numeric ground truth "
                             "-> text, prompt/response SFT -> messages")
    parser.add_argument("--against", type=Path, metavar="OTHER",
                        help="the other split (train or test) to check for overlap (default: the train.parquet / "
                             "test.parquet beside FILE)")
    args = parser.parse_args(argv)
    args.file, args.fix = Path(args.file), Path(args.fix) if args.fix else None
    refuse_symlink_loop(args.file, "FILE")
    if args.fix is not None:
        report, changes = fix_parquet(args.file, args.fix, args.kind, force=settings["FORCE"])
        say(f"wrote {args.fix} ({report.rows} rows; {'; '.join(changes) or 'nothing needed fixing'})")
    else:
        report = check_parquet(args.file, args.kind)
    other = args.against
    # make prep's layout: train.parquet is compared with test.parquet beside it, and the other way round
    partner = {"train.parquet": "test.parquet", "test.parquet": "train.parquet"}.get(args.file.name)
    if other is None and partner and args.file.with_name(partner).is_file():
        other = args.file.with_name(partner)
    overlap = compare_splits(*sorted([report, check_parquet(other, report.kind)],
                                     key=lambda r: r.path.name != "train.parquet")) if other is not None else None
    say(f"ok: {report.path}: {report.rows} rows, "
        f"{'RL (prompt, data_source, reward_model)' if report.kind == 'rl' else 'SFT (messages)'}")
    for note in report.notes + ([overlap] if overlap else []):
        warn(note)
    return 0

