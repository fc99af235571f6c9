"""Run a JSONL or Parquet job through Ray Data, one offline-paged engine per actor.

    python examples/ray_batch.py JOB.jsonl OUT.jsonl --model /models/SmolLM2 --actors 2 --gpus-per-actor 1
    python examples/ray_batch.py job.parquet out_dir.parquet --actors 4

Input: a .jsonl file of the job's lines (read as raw lines, so a bad line becomes an error row), or
a .parquet file whose columns are the job's fields. Output: .jsonl writes the job's records, one per
line (the same records `offline-paged generate` writes); anything else is written as Parquet (a
directory) with the columns id, error, text, record. On a cluster, start Ray first (`ray start
--head` on one machine, `ray start --address=HEAD:6379` on the others) and pass --address auto;
the input and output paths must then be reachable from every node (shared or object storage).
"""
import argparse
import math
import os

import ray

from offline_paged.ray import Processor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input")
    parser.add_argument("output")
    parser.add_argument("--model", default=None, help="HF model dir or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--actors", type=int, default=1, help="engines (one per GPU with --gpus-per-actor 1)")
    parser.add_argument("--gpus-per-actor", type=float, default=0)
    parser.add_argument("--cpus-per-actor", type=float, default=1)
    parser.add_argument("--batch-size", type=int, default=256, help="rows per engine call")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-tokens", type=int, default=None, help="job-wide default")
    parser.add_argument("--address", default=None, help="a Ray cluster ('auto'); default: a local one")
    args = parser.parse_args()

    if args.address is None:  # a local runtime: leave a CPU for the read task beside the actors,
        # else every CPU is held by an actor and the read waits for ever on a small machine
        needed = math.ceil(args.actors * args.cpus_per_actor) + 1
        ray.init(num_cpus=max(os.cpu_count() or 1, needed))
    else:
        ray.init(address=args.address)
    if args.input.endswith(".parquet"):
        ds, raw_column = ray.data.read_parquet(args.input), None
    else:
        ds, raw_column = ray.data.read_text(args.input), "text"
    defaults = {} if args.max_tokens is None else {"max_tokens": args.max_tokens}
    out = ds.map_batches(Processor, fn_constructor_kwargs=dict(
        model=args.model, raw_column=raw_column, defaults=defaults, device=args.device),
        concurrency=args.actors, num_gpus=args.gpus_per_actor, num_cpus=args.cpus_per_actor,
        batch_size=args.batch_size,
        batch_format="numpy")
    if args.output.endswith(".jsonl"):
        with open(args.output, "w", encoding="utf-8") as f:
            for row in out.iter_rows():
                f.write(row["record"] + "\n")
    else:
        out.write_parquet(args.output)


if __name__ == "__main__":
    main()
