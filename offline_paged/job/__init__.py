"""The JSONL job: input lines, output records, the output file and resume, Ray Data."""
