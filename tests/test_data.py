"""`prep gsm8k` and `data check`: real files, the real CLI, and verl's own scorer and dataset classes
as the judges of what we write."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
from conftest import REPO, assert_one_line_error, run_app

from app.data import INSTRUCTION, gsm8k_ground_truth, prep_gsm8k, routed_data_sources, verl_gsm8k_scorer

BUNDLED = REPO / "data" / "gsm8k_source"


def source_rows(split: str) -> list[dict]:
    with gzip.open(BUNDLED / f"{split}.jsonl.gz", "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, str]:
    """The bundled GSM8K prepared once through the real CLI: (DATA_DIR, stdout)."""
    data_dir = tmp_path_factory.mktemp("prepared") / "data"
    result = run_app("prep", "gsm8k", env={"DATA_DIR": str(data_dir), "GSM8K_SOURCE": ""})
    assert result.returncode == 0, result.stderr
    return data_dir, result.stdout


def verl_config(name: str, overrides: list[str]):
    """verl's own packaged Hydra config, composed as its entry points do."""
    import verl
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"),
                               version_base=None):
        return compose(name, overrides=overrides)


# --- prep on the real data -----------------------------------------------------------------------------
def test_prep_writes_all_gsm8k_rows_and_says_what_it_wrote(prepared):
    data_dir, stdout = prepared
    for name in ("gsm8k", "gsm8k_sft"):
        for split, rows in (("train", 7473), ("test", 1319)):
            path = data_dir / name / f"{split}.parquet"
            assert pq.read_metadata(path).num_rows == rows
            assert f"{path} ({rows} rows" in stdout
    assert sorted(p.name for p in data_dir.rglob("*")) == sorted(
        ["gsm8k", "gsm8k_sft", "train.parquet", "test.parquet", "train.parquet", "test.parquet"])


def test_verl_gsm8k_scorer_gives_every_reference_answer_full_marks(prepared):
    from verl.utils.reward_score.gsm8k import compute_score  # the oracle: what GRPO rewards with

    data_dir, _ = prepared
    scored = 0
    for split in ("train", "test"):
        for row in pq.read_table(data_dir / "gsm8k" / f"{split}.parquet").to_pylist():
            assert compute_score(row["extra_info"]["answer"], row["reward_model"]["ground_truth"]) == 1.0, row
            scored += 1
    assert scored == 8792


def test_rl_rows_follow_verl_schema_and_match_the_source(prepared):
    data_dir, _ = prepared
    for split in ("train", "test"):
        source = source_rows(split)
        rows = pq.read_table(data_dir / "gsm8k" / f"{split}.parquet").to_pylist()
        assert len(rows) == len(source)
        for index, (row, raw) in enumerate(zip(rows, source)):
            # ground truth computed independently of app.data: the text after '#### ', commas removed
            truth = raw["answer"].split("#### ")[-1].strip().replace(",", "")
            assert row == {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": raw["question"] + " " + INSTRUCTION}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": truth},
                "extra_info": {"split": split, "index": index, "answer": raw["answer"],
                               "question": raw["question"]},
            }
    assert INSTRUCTION == "Let's think step by step and output the final answer after \"####\"."


def test_rl_and_sft_files_agree_row_by_row(prepared):
    data_dir, _ = prepared
    for split in ("train", "test"):
        rl = pq.read_table(data_dir / "gsm8k" / f"{split}.parquet").to_pylist()
        sft = pq.read_table(data_dir / "gsm8k_sft" / f"{split}.parquet").to_pylist()
        assert len(rl) == len(sft)
        for a, b in zip(rl, sft):
            assert b["messages"] == [a["prompt"][0], {"role": "assistant", "content": a["extra_info"]["answer"]}]
            assert b["extra_info"] == a["extra_info"]


def test_prepared_rl_parquet_loads_through_verls_rl_dataset(prepared, tiny_model_dir, tmp_path):
    """verl's own create_rl_dataset + ppo_trainer data config: every prompt goes through the chat
    template (a prompt that fails templating is filtered out, so the length proves it)."""
    from transformers import AutoTokenizer
    from verl.trainer.ppo.utils import create_rl_dataset

    data_dir, _ = prepared
    config = verl_config("ppo_trainer", ["data.filter_overlong_prompts=true", f"+data.cache_dir={tmp_path}"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    dataset = create_rl_dataset([str(data_dir / "gsm8k" / "test.parquet")], config.data, tokenizer, None,
                                is_train=False)
    assert len(dataset) == 1319
    item = dataset[5]
    assert item["raw_prompt"][0]["role"] == "user" and item["raw_prompt"][0]["content"].endswith(INSTRUCTION)
    assert item["index"] == 5 and item["data_source"] == "openai/gsm8k"
    assert item["reward_model"]["ground_truth"] == gsm8k_ground_truth(item["extra_info"]["answer"])


def test_prompt_lengths_count_what_verls_length_filter_counts(prepared, tiny_model_dir, tmp_path):
    """app.data.prompt_lengths (batched, preflight) against verl's own RLHFDataset filter (row by row): at a
    limit that splits the GSM8K train prompts, verl keeps exactly the rows our counts put within it."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from app.data import prompt_lengths

    data_dir, _ = prepared
    train = data_dir / "gsm8k" / "train.parquet"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    lengths = prompt_lengths(train, tokenizer, chunk=1000)  # several chunks
    assert len(lengths) == 7473
    limit = sorted(lengths)[len(lengths) // 2]
    kept = sum(n <= limit for n in lengths)
    assert 0 < kept < len(lengths)
    dataset = RLHFDataset(str(train), tokenizer, OmegaConf.create({
        "cache_dir": str(tmp_path / "cache"), "max_prompt_length": limit, "filter_overlong_prompts": True,
        "filter_overlong_prompts_workers": 1}))
    assert len(dataset) == kept


def test_prepared_sft_parquet_loads_through_verls_sft_dataset(prepared, tiny_model_dir):
    """verl's sft_trainer dataset (MultiTurnSFTDataset via create_sft_dataset, its packaged data
    config): every test row tokenizes within max_length, and the loss covers exactly the answer."""
    from transformers import AutoTokenizer
    from verl.trainer.sft_trainer import create_sft_dataset

    data_dir, _ = prepared
    config = verl_config("sft_trainer_engine", [])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    dataset = create_sft_dataset([str(data_dir / "gsm8k_sft" / "test.parquet")], config.data, tokenizer, None)
    rows = pq.read_table(data_dir / "gsm8k_sft" / "test.parquet").to_pylist()
    assert len(dataset) == len(rows) == 1319
    for i in range(0, len(rows), 10):
        item = dataset[i]  # raises if per-turn tokenization disagrees with the whole chat, or too long
        trained = tokenizer.decode(item["input_ids"][item["loss_mask"].bool()])
        assert trained == rows[i]["messages"][1]["content"] + "<|im_end|>\n"


def test_loaded_scorer_is_verls_gsm8k_module():
    import verl.utils.reward_score.gsm8k as verl_gsm8k

    scorer = verl_gsm8k_scorer()
    assert Path(scorer.__code__.co_filename).resolve() == Path(verl_gsm8k.__file__).resolve()
    assert scorer("so #### 1,234", "1234") == 1.0 and scorer("so #### 5", "1234") == 0


def test_routed_data_sources_match_verls_default_scorer():
    from verl.utils.reward_score import default_compute_score

    names, prefixes = routed_data_sources()
    assert "openai/gsm8k" in names and "lighteval/MATH" in names and "aime" in prefixes
    code = {"codecontests", "apps", "codeforces", "taco"}  # those would execute the "solution"
    for name in sorted(names - code) + [p + "2024" for p in prefixes]:
        try:
            default_compute_score(name, "The answer is #### 1", "1")
        except NotImplementedError:
            pytest.fail(f"{name} is listed as routed but verl does not route it")
        except Exception:  # an optional scorer dependency missing here still means "routed"
            pass
    with pytest.raises(NotImplementedError):
        default_compute_score("my/own-dataset", "#### 1", "1")


def test_ground_truth_is_number_after_last_hashes_without_commas():
    assert gsm8k_ground_truth("a\nb #### 1,234") == "1234"
    assert gsm8k_ground_truth("x #### -0.5") == "-0.5"
    assert gsm8k_ground_truth("no final line") is None
    assert gsm8k_ground_truth("#### five") is None


# --- prep: source formats ------------------------------------------------------------------------------
def small_source(directory: Path, form: str, rows: int = 4) -> Path:
    directory.mkdir(parents=True)
    for split in ("train", "test"):
        data = source_rows(split)[:rows]
        if form == "jsonl":
            (directory / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
        elif form == "jsonl.gz":
            with gzip.open(directory / f"{split}.jsonl.gz", "wt") as handle:
                handle.writelines(json.dumps(r) + "\n" for r in data)
        elif form == "parquet":
            pd.DataFrame(data).to_parquet(directory / f"{split}.parquet")
        elif form == "hf-snapshot":  # layout of a local copy of the openai/gsm8k dataset repository
            (directory / "main").mkdir(exist_ok=True)
            pd.DataFrame(data).to_parquet(directory / "main" / f"{split}-00000-of-00001.parquet")
    return directory


@pytest.mark.parametrize("form", ["jsonl", "jsonl.gz", "parquet", "hf-snapshot"])
def test_prep_reads_every_source_form_to_the_same_rows(form, tmp_path):
    source = small_source(tmp_path / "src", form)
    written = prep_gsm8k(str(source), tmp_path / "out")
    assert set(written) == {"gsm8k/train", "gsm8k/test", "gsm8k_sft/train", "gsm8k_sft/test"}
    rows = pq.read_table(written["gsm8k/test"]).to_pylist()
    assert [r["extra_info"]["question"] for r in rows] == [r["question"] for r in source_rows("test")[:4]]
    assert rows[0]["reward_model"]["ground_truth"] == "18"


def test_prep_replaces_previous_output_and_keeps_other_files(tmp_path):
    source = small_source(tmp_path / "src", "jsonl")
    out = tmp_path / "out"
    (out / "gsm8k").mkdir(parents=True)
    (out / "gsm8k" / "mine.txt").write_text("keep me")
    (out / "gsm8k" / "train.parquet").write_text("old")
    prep_gsm8k(str(source), out)
    assert pq.read_metadata(out / "gsm8k" / "train.parquet").num_rows == 4
    assert (out / "gsm8k" / "mine.txt").read_text() == "keep me"
    assert not [p for p in out.rglob(".*")], "temporary files left behind"


# --- prep: bad input through the CLI, nothing written ----------------------------------------------------
def write_split_files(directory: Path, train: bytes | str, test: bytes | str | None = None,
                      suffix: str = "jsonl") -> Path:
    directory.mkdir(parents=True)
    good = "".join(json.dumps(r) + "\n" for r in source_rows("test")[:3])
    for split, content in (("train", train), ("test", good if test is None else test)):
        path = directory / f"{split}.{suffix}"
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    return directory


def good_lines(n: int = 3) -> str:
    return "".join(json.dumps(r) + "\n" for r in source_rows("train")[:n])


BAD_SOURCES = {
    # case: (build the source dir under tmp, expected words in the error)
    "missing path": (lambda d: d / "nowhere", r"GSM8K_SOURCE=.* does not exist"),
    "no train file": (lambda d: (d.mkdir(), d)[1], r"has no train\.jsonl"),
    "corrupt jsonl": (lambda d: write_split_files(d, good_lines() + '{"question": "q", "answer\n'),
                      r"train\.jsonl line 4 is not valid JSON"),
    "corrupt gzip": (lambda d: write_split_files(
        d, gzip.compress(good_lines(50).encode())[:300], gzip.compress(good_lines().encode()), "jsonl.gz"),
        r"train\.jsonl\.gz cannot be read"),
    "corrupt parquet": (lambda d: write_split_files(d, b"PAR1 this is not parquet", b"garbage", "parquet"),
                        r"train\.parquet is not a readable parquet file"),
    "answer without ####": (lambda d: write_split_files(
        d, good_lines(2) + json.dumps({"question": "q?", "answer": "it is 5"}) + "\n"),
        r"train\.jsonl line 3: the answer does not end with '#### <number>'"),
    "non-numeric final answer": (lambda d: write_split_files(
        d, json.dumps({"question": "q?", "answer": "so #### five"}) + "\n"), r"line 1: the answer does not end"),
    "hashes without space": (lambda d: write_split_files(
        d, json.dumps({"question": "q?", "answer": "so ####5"}) + "\n"), r"verl's gsm8k scorer gives"),
    "missing question": (lambda d: write_split_files(d, json.dumps({"answer": "#### 5"}) + "\n"),
                         r"line 1 has no text `question`"),
    "empty dataset": (lambda d: write_split_files(d, "\n"), r"train\.jsonl has no rows"),
}


@pytest.mark.parametrize("case", sorted(BAD_SOURCES))
def test_prep_bad_source_is_one_line_error_and_writes_nothing(case, tmp_path):
    build, expected = BAD_SOURCES[case]
    source = build(tmp_path / "src")
    data_dir = tmp_path / "data"
    line = assert_one_line_error(run_app("prep", "gsm8k", env={"GSM8K_SOURCE": str(source),
                                                                 "DATA_DIR": str(data_dir)}))
    assert re.search(expected, line), line
    assert not data_dir.exists()


def test_prep_from_hub_without_network_is_one_line_error(tmp_path):
    data_dir = tmp_path / "data"
    line = assert_one_line_error(run_app("prep", "gsm8k", env={
        "GSM8K_SOURCE": "hf", "DATA_DIR": str(data_dir), "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "cache")}))
    assert "openai/gsm8k" in line and "unset GSM8K_SOURCE" in line
    assert not data_dir.exists()


def test_failed_prep_leaves_existing_output_untouched(tmp_path):
    data_dir = tmp_path / "data"
    prep_gsm8k(str(small_source(tmp_path / "good", "jsonl")), data_dir)
    before = {p: p.read_bytes() for p in data_dir.rglob("*.parquet")}
    source = write_split_files(tmp_path / "bad", good_lines(), json.dumps({"question": "q", "answer": "x"}))
    assert_one_line_error(run_app("prep", "gsm8k", env={"GSM8K_SOURCE": str(source), "DATA_DIR": str(data_dir)}))
    assert {p: p.read_bytes() for p in data_dir.rglob("*") if p.is_file()} == before


def test_prep_usage_mistakes_are_one_line_errors():
    assert "gsm9k" in assert_one_line_error(run_app("prep", "gsm9k"))
    assert "--help" in assert_one_line_error(run_app("prep", "--no-such-option"))


# --- data check --------------------------------------------------------------------------------------------
def rl_frame(**columns) -> pd.DataFrame:
    base = {"data_source": ["openai/gsm8k", "openai/gsm8k"],
            "prompt": [[{"role": "user", "content": "1+1?"}], [{"role": "user", "content": "2+2?"}]],
            "reward_model": [{"style": "rule", "ground_truth": "2"}, {"style": "rule", "ground_truth": "4"}]}
    base.update(columns)
    return pd.DataFrame({k: v for k, v in base.items() if v is not None})


def test_data_check_accepts_prepared_files_and_infers_kind(prepared):
    data_dir, _ = prepared
    result = run_app("data", "check", str(data_dir / "gsm8k" / "test.parquet"))
    assert result.returncode == 0 and "1319 rows, RL" in result.stdout and result.stderr == ""
    result = run_app("data", "check", str(data_dir / "gsm8k_sft" / "test.parquet"))
    assert result.returncode == 0 and "1319 rows, SFT" in result.stdout


def test_unrouted_data_source_passes_with_custom_reward_note(tmp_path):
    path = tmp_path / "mine.parquet"
    rl_frame(data_source=["my/dataset", "openai/gsm8k"]).to_parquet(path)
    result = run_app("data", "check", str(path), "--kind", "rl")
    assert result.returncode == 0, result.stderr
    assert "'my/dataset' (1 rows) is not routed" in result.stderr
    assert "reward.custom_reward_function.path" in result.stderr
    assert "openai/gsm8k" not in result.stderr


BAD_FILES = {
    # case: (write the file at path, kind or None, expected words in the error)
    "missing file": (lambda p: None, None, r"does not exist"),
    "corrupt parquet": (lambda p: p.write_bytes(b"PAR1 garbage PAR1"), None, r"not a readable parquet"),
    "empty file": (lambda p: rl_frame().iloc[:0].to_parquet(p), "rl", r"has no rows"),
    "string prompt": (lambda p: rl_frame(prompt=["1+1?", "2+2?"]).to_parquet(p), "rl",
                      r"`prompt` is a plain string.*--fix"),
    "missing ground truth": (lambda p: rl_frame(reward_model=[{"style": "rule", "ground_truth": "2"},
                                                               {"style": "rule", "ground_truth": None}]).to_parquet(p),
                             "rl", r"row 1 has no reward_model\.ground_truth"),
    "no reward_model column": (lambda p: rl_frame(reward_model=None).to_parquet(p), "rl", r"no `reward_model`"),
    "no data_source column": (lambda p: rl_frame(data_source=None).to_parquet(p), "rl", r"no `data_source`"),
    "unknown role": (lambda p: rl_frame(prompt=[[{"role": "user", "content": "a"}],
                                                [{"role": "system", "content": "b"}, {"role": "human", "content": "c"}]]
                                        ).to_parquet(p), "rl", r"row 1 has a message with role 'human'"),
    "empty prompt list": (lambda p: rl_frame(prompt=[[{"role": "user", "content": "a"}], []]).to_parquet(p),
                          "rl", r"row 1 has an empty `prompt`"),
    "sft without messages": (lambda p: rl_frame().to_parquet(p), "sft", r"no `messages` column"),
    "sft string messages": (lambda p: pd.DataFrame({"messages": ["hi"]}).to_parquet(p), "sft",
                            r"`messages` is a plain string"),
    "sft without assistant": (lambda p: pd.DataFrame({"messages": [
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
        [{"role": "user", "content": "only a question"}]]}).to_parquet(p), "sft", r"row 1 has no assistant message"),
    "neither column": (lambda p: pd.DataFrame({"text": ["x"]}).to_parquet(p), None,
                       r"neither a `prompt` column.*nor a `messages`"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_data_check_bad_file_is_one_line_error(case, tmp_path):
    write, kind, expected = BAD_FILES[case]
    path = tmp_path / "in.parquet"
    write(path)
    args = ["data", "check", str(path)] + (["--kind", kind] if kind else [])
    line = assert_one_line_error(run_app(*args))
    assert re.search(expected, line), line


def test_fix_turns_string_prompts_into_chat_that_verl_loads(tmp_path, tiny_model_dir):
    """A file as `datasets` writes it (its own feature metadata says `prompt` is text): after --fix
    verl's RLHFDataset reads chat lists, and a JSON-encoded chat is decoded, not wrapped."""
    import datasets
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+3?"}]
    source = tmp_path / "strings.parquet"
    datasets.Dataset.from_dict({
        "prompt": ["1+1?", json.dumps(chat)], "data_source": ["openai/gsm8k"] * 2,
        "reward_model": [{"style": "rule", "ground_truth": "2"}, {"style": "rule", "ground_truth": "6"}],
    }).to_parquet(str(source))
    fixed = tmp_path / "fixed.parquet"
    result = run_app("data", "check", str(source), "--fix", str(fixed))
    assert result.returncode == 0, result.stderr
    assert "2 string prompts rewritten" in result.stdout and "ok:" in result.stdout
    assert run_app("data", "check", str(fixed)).returncode == 0
    assert pd.read_parquet(fixed)["prompt"].map(len).tolist() == [1, 2]  # pandas reads it too

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    dataset = RLHFDataset(str(fixed), tokenizer, {"cache_dir": str(tmp_path / "cache"),
                                                  "filter_overlong_prompts": True,
                                                  "filter_overlong_prompts_workers": 1})
    assert len(dataset) == 2
    assert dataset[0]["raw_prompt"] == [{"role": "user", "content": "1+1?"}]
    assert dataset[1]["raw_prompt"] == chat


def test_fix_refuses_and_writes_nothing_when_other_problems_remain(tmp_path):
    source = tmp_path / "in.parquet"
    rl_frame(prompt=["1+1?", "2+2?"], reward_model=[{"style": "rule", "ground_truth": "2"}, None]).to_parquet(source)
    out = tmp_path / "out.parquet"
    line = assert_one_line_error(run_app("data", "check", str(source), "--fix", str(out)))
    assert "row 1 has no reward_model.ground_truth" in line
    assert str(source) in line and str(out) not in line  # the input is what has to change
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.parquet"]


def test_fix_never_overwrites_without_force(tmp_path):
    source = tmp_path / "in.parquet"
    rl_frame(prompt=["1+1?", "2+2?"]).to_parquet(source)
    out = tmp_path / "out.parquet"
    out.write_text("precious")
    assert "FORCE=1" in assert_one_line_error(run_app("data", "check", str(source), "--fix", str(out)))
    assert out.read_text() == "precious"
    assert "new path" in assert_one_line_error(run_app("data", "check", str(source), "--fix", str(source)))
    assert run_app("data", "check", str(source), "--fix", str(out), env={"FORCE": "1"}).returncode == 0
    assert pq.read_metadata(out).num_rows == 2
    # a directory is no file to replace, FORCE or not: the refusal names a file to write instead
    line = assert_one_line_error(run_app("data", "check", str(source), "--fix", str(tmp_path), env={"FORCE": "1"}))
    assert line == f"error: FIX={tmp_path} is a directory: name the file to write, e.g. FIX={tmp_path / 'in.fixed.parquet'}"


def test_prompt_lengths_count_a_row_the_template_refuses_as_verl_does(tmp_path, tiny_model_dir):
    """verl's filter counts a row whose chat template fails as max_prompt_length + 1 (dropped); so does the count,
    and the other rows of that chunk keep their own lengths."""
    from transformers import AutoTokenizer

    from app.data import prompt_lengths

    path = tmp_path / "rl.parquet"
    rl_frame(prompt=[[{"role": "user", "content": "1+1?"}], [{"role": "user", "content": "bad"}]],
             reward_model=[{"style": "rule", "ground_truth": "2"}] * 2).to_parquet(path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    good = prompt_lengths(path, tokenizer)[0]
    loop = "{%- for message in messages %}"
    assert loop in tokenizer.chat_template
    tokenizer.chat_template = tokenizer.chat_template.replace(
        loop, loop + "{% if message['content'] == 'bad' %}{{ raise_exception('no') }}{% endif %}", 1)
    assert prompt_lengths(path, tokenizer, failed=513) == [good, 513]


def test_counted_lengths_come_back_from_the_cache_until_the_data_or_a_tokenizer_file_changes(tmp_path, tiny_model_dir,
                                                                                             monkeypatch):
    """Preflight's counts are kept per user (~/.cache/verl-stack/lengths): the same data and tokenizer count again
    without loading a tokenizer; a changed data file, chat template or recipe counts anew, never a stale answer. A
    cache that is corrupt or cannot be written is counted around."""
    import shutil

    from transformers import AutoTokenizer

    from app.data import cached_lengths, prompt_lengths

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    path = tmp_path / "rl.parquet"
    rl_frame().to_parquet(path)
    loads = []

    def tokenizer():
        loads.append(1)
        return AutoTokenizer.from_pretrained(model)

    recipe = {"prompt_key": "prompt"}
    first = cached_lengths(path, model, tokenizer, recipe, recipe)
    assert first == prompt_lengths(path, AutoTokenizer.from_pretrained(model)) and len(loads) == 1
    assert cached_lengths(path, model, tokenizer, recipe, recipe) == first and len(loads) == 1  # no tokenizer loaded
    stored = list((tmp_path / "cache" / "verl-stack" / "lengths").iterdir())
    assert len(stored) == 1 and json.loads(stored[0].read_text()) == first

    rl_frame(prompt=[[{"role": "user", "content": "1+1? " * 20}]] * 2).to_parquet(path)  # the data changed
    longer = cached_lengths(path, model, tokenizer, recipe, recipe)
    assert len(loads) == 2 and longer[0] > first[0] + 20
    (model / "chat_template.jinja").write_text("{{ 'x' * 0 }}" + (model / "chat_template.jinja").read_text())
    assert cached_lengths(path, model, tokenizer, recipe, recipe) == longer and len(loads) == 3  # a template changed
    other = {"prompt_key": "prompt", "generation_prompt": False}
    assert cached_lengths(path, model, tokenizer, other, other) < longer and len(loads) == 4  # the recipe changed

    for stale in (tmp_path / "cache" / "verl-stack" / "lengths").iterdir():
        stale.write_text("[1, 2")  # a torn file
    assert cached_lengths(path, model, tokenizer, other, other) < longer and len(loads) == 5
    assert cached_lengths(path, model, tokenizer, other, other) < longer and len(loads) == 5  # written whole again

    monkeypatch.setenv("XDG_CACHE_HOME", str(path))  # a file: no cache directory can be made there
    assert cached_lengths(path, model, tokenizer, recipe, recipe) == longer and len(loads) == 6
