"""`python -m app eval` (`make eval STEP=N` or `make eval MODEL=path`): GSM8K test accuracy of a merged
model, scored by verl's own GSM8K scorer (verl.utils.reward_score.gsm8k.compute_score, strict `#### n`:
the reward GRPO trained on).

Generation is greedy and batched: vLLM when it is importable and a GPU is visible, else transformers
(on the GPU if any, else CPU: fine for small models and a LIMIT). EVAL_BACKEND=reference answers each
question with the dataset's own reference solution instead: a check of the data and the scorer that
loads no model and must score 100%.

Settings: MODEL (a Hugging Face model directory) or STEP (then OUT_DIR, else models/<run>-step<N> as
`make merge` writes it), DATA_DIR (reads DATA_DIR/gsm8k/test.parquet, the RL file `make prep` writes)
or --data FILE, LIMIT (first N rows), OUT (default: <model>/eval), EVAL_BACKEND=auto|vllm|hf|reference,
EVAL_BATCH, MAX_NEW_TOKENS (default 1024), EVAL_TP (vLLM tensor parallel size, default 1).
Writes OUT/summary.json and OUT/samples.jsonl (question, response, extracted answer, correct), atomically.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import time
from pathlib import Path

from app import node
from app.common import ArgParser, UserError, atomic_path, directory_problem, file_problem, resolved, say, warn
from app.data import verl_gsm8k_module
from app.runs import merged_model_for_step, read_model, step_arg
from app.settings import Settings, setting_type

BACKENDS = ("auto", "vllm", "hf", "reference")


# --- which model, which rows ----------------------------------------------------------------------

def check_model_dir(model: Path) -> None:
    problems = read_model(model).problems
    if problems == ("not a directory",):
        raise UserError(f"model {model} does not exist: pass MODEL=<Hugging Face model directory> or "
                        "STEP=<merged step>")
    if problems:
        raise UserError(f"{model} has {problems[0]}: MODEL must be a complete Hugging Face model directory "
                        "(a merged one: `make merge STEP=N`)")


def load_rows(path: Path, limit: int | None) -> list[dict]:
    """GSM8K rows of verl's RL parquet: prompt (chat list), reward_model.ground_truth, extra_info."""
    import pyarrow.parquet as pq

    problem = file_problem(path)  # by stat: a FIFO is refused, not opened (that would wait forever)
    if problem == "does not exist":
        raise UserError(f"test data {path} does not exist: run `make prep` (DATA_DIR) or set EVAL_FILE")
    if problem:
        raise UserError(f"test data {path} {problem}: set EVAL_FILE to a parquet file (or DATA_DIR to `make prep`'s)")
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a broken file
        raise UserError(f"{path} is not a readable parquet file ({exc}): rerun `make prep`") from None
    missing = [c for c in ("prompt", "reward_model") if c not in table.column_names]
    if missing:
        raise UserError(f"{path} lacks column(s) {', '.join(missing)}: it is not verl's RL format; use "
                        "DATA_DIR/gsm8k/test.parquet from `make prep`, or `python -m app data check` it")
    if limit is not None:
        table = table.slice(0, limit)
    rows = table.to_pylist()
    if not rows:
        raise UserError(f"{path} has no rows to evaluate")
    other = {r.get("data_source") for r in rows} - {"openai/gsm8k", None}
    if other:
        warn(f"data_source {', '.join(map(str, sorted(other)))} is not openai/gsm8k: scored with the GSM8K "
             "scorer all the same")
    for i, row in enumerate(rows):
        truth = (row.get("reward_model") or {}).get("ground_truth")
        if not isinstance(row.get("prompt"), list) or truth in (None, ""):
            raise UserError(f"{path} row {i}: needs a chat-list `prompt` and reward_model.ground_truth; "
                            "check it with `python -m app data check`")
    return rows


def question_of(row: dict) -> str:
    return (row.get("extra_info") or {}).get("question") or next(
        (m["content"] for m in reversed(row["prompt"]) if m.get("role") == "user"), "")


# --- generation -----------------------------------------------------------------------------------

def chat_prompts(tokenizer, rows: list[dict]) -> list[str]:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("the model's tokenizer has no chat template: evaluate a chat/instruct model (the "
                        "merged one carries its base model's template)")
    return [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]


def generate_vllm(model: Path, rows: list[dict], max_new: int, tp: int = 1) -> list[str]:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    prompts = chat_prompts(AutoTokenizer.from_pretrained(model), rows)
    llm = LLM(model=str(model), tensor_parallel_size=tp, dtype="bfloat16", seed=0,
              gpu_memory_utilization=0.85)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_new), use_tqdm=True)
    return [o.outputs[0].text for o in outputs]


def generate_hf(model_dir: Path, rows: list[dict], max_new: int, batch: int) -> list[str]:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"  # decoder-only batch generation continues from the right edge
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    prompts = chat_prompts(tokenizer, rows)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if device == "cuda"
                                                 else torch.float32).to(device).eval()
    # longest first, so padding within a batch stays small and memory peaks early
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    texts: list[str] = [""] * len(prompts)
    with tqdm(total=len(prompts), desc=f"generating ({device})", unit="q") as bar, torch.inference_mode():
        for start in range(0, len(order), batch):
            ids = order[start:start + batch]
            enc = tokenizer([prompts[i] for i in ids], return_tensors="pt", padding=True,
                            add_special_tokens=False).to(device)
            out = model.generate(**enc, max_new_tokens=max_new, do_sample=False, temperature=None, top_p=None,
                                 top_k=None, pad_token_id=tokenizer.pad_token_id)
            decoded = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            for i, text in zip(ids, decoded):
                texts[i] = text
            bar.update(len(ids))
    return texts


def reference_answers(rows: list[dict]) -> list[str]:
    return [(row.get("extra_info") or {}).get("answer") or f"#### {row['reward_model']['ground_truth']}"
            for row in rows]


def pick_backend(requested: str, gpus: int) -> str:
    if requested not in BACKENDS:
        raise UserError(f"EVAL_BACKEND={requested!r}: choose one of {', '.join(BACKENDS)}")
    has_vllm = importlib.util.find_spec("vllm") is not None
    if requested == "vllm" and not (has_vllm and gpus):
        raise UserError("EVAL_BACKEND=vllm needs vLLM and a visible GPU: run on a GPU node in the image, or "
                        "set EVAL_BACKEND=hf (transformers)")
    if requested == "auto":
        return "vllm" if has_vllm and gpus else "hf"
    return requested


# --- the evaluation -------------------------------------------------------------------------------

def evaluate(model: Path, data: Path, out: Path, limit: int | None, backend: str, batch: int | None,
             max_new: int, *, gpus: int = 0, tp: int = 1) -> dict:
    """`gpus`: the GPUs visible here (app.node); `tp`: vLLM's tensor parallel size (EVAL_TP)."""
    check_model_dir(model)
    scorer = verl_gsm8k_module()  # compute_score and extract_solution, as `make prep` checks with them
    if scorer is None:
        raise UserError("verl is not importable here: install verl==0.9.1 (make setup) or use the image")
    rows = load_rows(data, limit)
    backend = pick_backend(backend, gpus)
    how = "its reference answers" if backend == "reference" else f"{backend} (greedy, up to {max_new} new tokens)"
    say(f"evaluating {model} on {len(rows)} rows of {data} with {how}")
    started = time.time()
    if backend == "vllm":
        responses = generate_vllm(model, rows, max_new, tp)
    elif backend == "hf":
        responses = generate_hf(model, rows, max_new, batch or (32 if gpus else 8))
    else:
        responses = reference_answers(rows)
    seconds = time.time() - started
    samples = []
    for i, (row, response) in enumerate(zip(rows, responses)):
        truth = str(row["reward_model"]["ground_truth"])
        score = float(scorer.compute_score(response, truth))  # verl's reward for this response
        samples.append({"index": (row.get("extra_info") or {}).get("index", i), "question": question_of(row),
                        "ground_truth": truth, "response": response,
                        "extracted": scorer.extract_solution(response, method="strict"),
                        "correct": score == 1.0})
    correct = sum(s["correct"] for s in samples)
    summary = {
        "model": str(model), "data": str(data), "rows": len(samples), "limit": limit, "backend": backend,
        "correct": correct, "accuracy": correct / len(samples),
        "formatted": sum(s["extracted"] is not None for s in samples) / len(samples),
        "scorer": "verl.utils.reward_score.gsm8k.compute_score (strict '#### <number>')",
        "max_new_tokens": max_new, "seconds": round(seconds, 2),  # model load + generation
        "finished_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    with atomic_path(out) as tmp:
        tmp.mkdir()
        (tmp / "samples.jsonl").write_text("".join(json.dumps(s, ensure_ascii=False) + "\n" for s in samples),
                                           encoding="utf-8")
        (tmp / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary


def main(command: str, argv: list[str], settings: Settings) -> int:
    parser = ArgParser(prog="python -m app eval", description=__doc__)
    parser.add_argument("--model", default=settings["MODEL"], help="Hugging Face model directory (MODEL)")
    parser.add_argument("--step", default=settings["STEP"], type=step_arg, help="merged step, when no MODEL (STEP)")
    parser.add_argument("--data", default=settings["EVAL_FILE"],
                        help="RL parquet (EVAL_FILE; default DATA_DIR/gsm8k/test.parquet)")
    # LIMIT and EVAL_BATCH are at least 1 (the registry's rule, for the flags too): LIMIT=0 once meant every row
    parser.add_argument("--limit", type=setting_type("LIMIT"), default=settings["LIMIT"], help="first N rows (LIMIT)")
    parser.add_argument("--out", default=settings["OUT"], help="output directory (OUT; default <model>/eval)")
    parser.add_argument("--backend", default=settings["EVAL_BACKEND"], help=f"{'|'.join(BACKENDS)}")
    parser.add_argument("--batch", type=setting_type("EVAL_BATCH"), default=settings["EVAL_BATCH"], help="EVAL_BATCH")
    parser.add_argument("--max-new-tokens", type=int, default=settings["MAX_NEW_TOKENS"])
    args = parser.parse_args(argv)
    if args.model:
        model = resolved(args.model, "MODEL")
    elif args.step:
        model = merged_model_for_step(args.step, settings)
    else:
        raise UserError("which model? pass MODEL=<model directory> or STEP=<merged step> (make merge STEP=N first)")
    if args.max_new_tokens < 1:
        raise UserError(f"MAX_NEW_TOKENS={args.max_new_tokens}: set a positive number")
    data = Path(args.data) if args.data else Path(settings["DATA_DIR"]) / "gsm8k" / "test.parquet"
    out = resolved(args.out, "OUT") if args.out else model / "eval"
    problem = directory_problem(out)
    if problem:  # before the model loads and generates for minutes
        raise UserError(f"the eval output {out} {problem}: set OUT to a directory you can write")
    summary = evaluate(model, resolved(data, "EVAL_FILE" if args.data else "DATA_DIR"), out, args.limit,
                       args.backend, args.batch, args.max_new_tokens,
                       gpus=node.gpus(settings["CUDA_VISIBLE_DEVICES"]).count or 0, tp=settings["EVAL_TP"])
    task = "GSM8K" if data.parent.name == "gsm8k" else data.parent.name  # prep writes <task>/test.parquet
    say(f"{task} accuracy {summary['accuracy']:.2%} ({summary['correct']}/{summary['rows']}, "
        f"{summary['formatted']:.0%} gave a '#### n' answer) with {summary['backend']}; "
        f"details in {out}/summary.json and samples.jsonl")
    return 0
