"""RequestProgress: the tqdm bar `LLM.generate(..., use_tqdm=True)` shows, as vLLM's does: finished
prompts out of all, with input and output tokens per second since the call started."""
from __future__ import annotations

import time
from collections.abc import Callable

from offline_paged.core.outputs import RequestOutput


class RequestProgress:
    """`use_tqdm`: True (tqdm on stderr), False (no bar), or a tqdm-like class to build the bar with."""

    def __init__(self, total: int, use_tqdm: bool | Callable = True, desc: str = "Processed prompts") -> None:
        self._bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            make = tqdm if use_tqdm is True else use_tqdm
            self._bar = make(total=total, desc=desc, dynamic_ncols=True)
        self._start = time.perf_counter()
        self._input_tokens = 0
        self._output_tokens = 0

    def update(self, output: RequestOutput) -> None:
        if self._bar is None:
            return
        self._input_tokens += len(output.prompt_token_ids)
        self._output_tokens += sum(len(c.token_ids) for c in output.outputs)
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        self._bar.set_postfix_str(f"est. speed input: {self._input_tokens / elapsed:.2f} toks/s, "
                                  f"output: {self._output_tokens / elapsed:.2f} toks/s", refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
