"""offline_paged.job.ray.Processor: the JSONL job's records through a Ray Data batch. The processor is
plain Python (tested here without Ray, on NumPy-column, pandas-like and raw-line batches); one test
runs it under a local Ray runtime when Ray is installed (`offline-paged[ray]`, not in CI)."""
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from fixtures_tiny_model import write_tiny_model
from offline_paged.cli.main import cli
from offline_paged.job.ray import Processor

ENGINE = dict(device="cpu", dtype="float64", block_size=4, num_kv_blocks=64, max_num_seqs=4,
              max_model_len=64)
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float64", "--block-size", "4", "--num-kv-blocks", "64",
                "--max-num-seqs", "4", "--max-model-len", "64", "--no-progress"]
ROWS = [
    {"id": "a", "prompt": "The sky is", "max_tokens": 5, "temperature": 0},
    {"id": "b", "prompt": "Once upon", "max_tokens": 7, "seed": 4, "n": 2},
    {"id": "bad-field", "prompt": "x", "colour": "red"},
    {"id": "c", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "seed": 1},
    {"id": "too-long", "prompt_token_ids": list(range(70)), "max_tokens": 2},
    {"custom_id": "oa", "method": "POST", "url": "/v1/completions",
     "body": {"model": "m", "prompt": "Once", "max_tokens": 3, "temperature": 0}},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def job_records(model_dir, tmp_path_factory) -> dict[str, dict]:
    """The JSONL job's records for ROWS: what the processor must reproduce."""
    tmp = tmp_path_factory.mktemp("job")
    job, out = tmp / "job.jsonl", tmp / "out.jsonl"
    job.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    result = CliRunner().invoke(cli, ["generate", str(job), "-o", str(out), "--model", str(model_dir),
                                      *ENGINE_FLAGS])
    assert result.exit_code == 1, result.output
    return {r.get("custom_id") or r["id"]: r for r in map(json.loads, out.read_text().splitlines())}


def _comparable(record: dict):
    """A record less what differs per run (OpenAI ids carry a run id; fp64 logprobs to rounding)."""
    if "custom_id" in record:
        return record["response"]["status_code"], record["response"]["body"].get("choices")
    if record.get("error"):  # its "line N:" counts within the batch
        return record["error"]["type"], record["error"]["message"].split(": ", 1)[1]
    return [(o["token_ids"], o["text"], o["finish_reason"], round(o["cumulative_logprob"], 9))
            for o in record["outputs"]]


def _check(result: dict, job_records: dict) -> None:
    assert result["id"] == [r.get("custom_id") or r["id"] for r in ROWS]  # 1:1, input order
    records = [json.loads(r) for r in result["record"]]
    for row_id, record in zip(result["id"], records):
        assert _comparable(record) == _comparable(job_records[row_id]), row_id
    errors = dict(zip(result["id"], result["error"]))
    assert errors["bad-field"] and "colour" in errors["bad-field"]
    assert errors["too-long"] and "max_model_len" in errors["too-long"]
    assert errors["a"] is None and errors["oa"] is None
    assert result["text"][0] == records[0]["text"]


def test_raw_jsonl_lines_give_the_jobs_records_in_input_order(model_dir, job_records):
    processor = Processor(str(model_dir), raw_column="text", **ENGINE)
    batch = {"text": np.array([json.dumps(r) for r in ROWS] + ["not json"], dtype=object)}
    result = processor(batch)
    assert result["id"][-1] == "line-7" and "invalid JSON" in result["error"][-1]
    _check({k: v[:-1] for k, v in result.items()}, job_records)


def test_structured_columns_with_gaps_give_the_same_records(model_dir, job_records):
    """Columns as Ray's NumPy batches hold them: absent fields None, int columns with gaps float."""
    names = sorted({k for r in ROWS for k in r})
    columns = {name: np.array([r.get(name) for r in ROWS], dtype=object) for name in names}
    columns["max_tokens"] = np.array([float(r.get("max_tokens", np.nan)) for r in ROWS])
    result = Processor(str(model_dir), **ENGINE)(columns)
    _check(result, job_records)


def test_processor_under_a_local_ray_runtime(model_dir, job_records):
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ds = ray.data.from_items([{"text": json.dumps(r)} for r in ROWS])
        out = ds.map_batches(Processor, fn_constructor_kwargs={"model": str(model_dir), "raw_column": "text",
                                                               **ENGINE},
                             concurrency=1, batch_size=3, batch_format="numpy").take_all()
    finally:
        ray.shutdown()
    result = {name: [row[name] for row in out] for name in ("id", "error", "text", "record")}
    _check(result, job_records)


def test_every_row_gives_one_row_whatever_its_cells_hold(model_dir):
    """A datetime, bytes or a Decimal once failed the whole batch; blank and None rows vanished and
    shifted the line-N ids of the rows after them."""
    import datetime
    from decimal import Decimal

    processor = Processor(str(model_dir), **ENGINE)
    rows = [{"prompt": "a", "max_tokens": Decimal("2"), "temperature": Decimal("0.0")},
            {"prompt": "b", "when": datetime.datetime(2026, 1, 1)},
            {"prompt": b"The sky is", "max_tokens": 2},
            {"prompt": b"\xff\xfe", "max_tokens": 2},
            {"prompt": None, "max_tokens": None},
            {"prompt": "c", "max_tokens": float("inf")},
            {"prompt": "last", "max_tokens": 2}]
    result = processor({name: np.array([r.get(name) for r in rows], dtype=object)
                        for name in ("prompt", "max_tokens", "temperature", "when")})
    assert result["id"] == [f"line-{i}" for i in range(1, 8)]
    errors = result["error"]
    assert errors[0] is None and errors[2] is None and errors[6] is None, errors
    assert "datetime, which is not a JSON value" in errors[1]
    assert "not UTF-8" in errors[3] and errors[4] and errors[5]

    result = Processor(str(model_dir), raw_column="text", **ENGINE)({"text": np.array([json.dumps({"prompt": "a", "max_tokens": 2}), None, "  ",
                                    json.dumps({"prompt": "z", "max_tokens": 2})], dtype=object)})
    assert result["id"] == ["line-1", "line-2", "line-3", "line-4"]
    assert result["error"][0] is None and result["error"][3] is None
    assert "blank" in result["error"][1] and "blank" in result["error"][2]
