"""StopChecker: decides, after each appended token, whether a sequence is done (vLLM's rules).

Order of checks (vLLM's): nothing stops a sequence before `min_tokens` except the length limits;
then EOS (unless ignore_eos), stop_token_ids, stop strings; then max_tokens and max_model_len.
Structured output: a sequence with a grammar matcher feeds it every appended token first; a token the
grammar refuses ends the sequence (ABORT, `seq.error` says why: the engine turns it into the request's
error), and a completed grammar ends it (STOP) whatever min_tokens says, since nothing else may follow.
A token fed ahead whose outcome a mask server is still computing is checked last, by `settle`, once the
output processor has seen the step's other sequences (the wait for the workers' reply hides behind them);
the result is the same as checking it first: a refusal wins over any other reason, a completion over none.
Stop strings are searched in incrementally detokenized text (never half a character); the text of a
sequence stopped by a string ends just before it, as in vLLM (or just after it with
`include_stop_str_in_output`). The token ids are kept whole. `detokenize=False` gives empty text.
"""
from __future__ import annotations

from offline_paged.core.sequence import FinishReason, Sequence, SequenceStatus
from offline_paged.models.detokenizer import IncrementalDetokenizer

StopDecision = tuple[FinishReason, int | str | None]


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def __call__(self, seq: Sequence, pending: list[Sequence] | None = None) -> StopDecision | None:
        """Look at seq's newest token; return (reason, stop_reason) if it must stop now.

        pending: where a sequence goes whose grammar outcome for this token a mask server is still
        computing (fed ahead, `StructuredMatcher.outcome_pending`); it is checked for everything else now,
        and `settle` applies the outcomes once the caller has seen the whole step. None: wait for it here."""
        params = seq.group.params
        token_ids = seq.token_ids
        token_id = token_ids[-1]
        num_known = len(token_ids)  # seq.num_known_tokens (read inline: this runs for every sequence every step)
        num_outputs = num_known - seq.num_prompt_tokens  # a lookahead step's pending token does not count
        matcher = seq.matcher
        if matcher is not None:
            if pending is not None and matcher.outcome_pending:
                pending.append(seq)
                matcher = None  # (its grammar checks wait for settle)
            else:
                seq.error = matcher.accept(token_id)
                if seq.error is not None:
                    return FinishReason.ABORT, None
        if num_outputs >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                seq.finished_by_eos = True
                return FinishReason.STOP, token_id
            if token_id in params.stop_token_ids:
                return FinishReason.STOP, token_id
            if params.stop:
                hit = self._find_stop_string(seq)
                if hit is not None:
                    return FinishReason.STOP, hit
        elif params.stop:
            self._detokenizer(seq).push([token_id])  # keep the text current for later checks
        if num_outputs >= params.max_tokens or num_known >= self.max_model_len:
            return FinishReason.LENGTH, None
        if matcher is not None and matcher.is_finished:
            return FinishReason.STOP, None
        return None

    @staticmethod
    def settle(pending: list[Sequence]) -> list[tuple[Sequence, StopDecision]]:
        """The grammar outcomes of the newest tokens of `pending` (sequences `__call__` checked without
        them): (seq, decision) for each sequence they end. A refused token ends its sequence with ABORT,
        over any reason found meanwhile (the grammar is checked first); a completed grammar ends one that
        nothing else ended (it is checked last)."""
        decisions = []
        for seq in pending:
            seq.error = seq.matcher.accept(seq.token_ids[-1])
            if seq.error is not None:
                decisions.append((seq, (FinishReason.ABORT, None)))
            elif seq.status is not SequenceStatus.FINISHED and seq.matcher.is_finished:
                decisions.append((seq, (FinishReason.STOP, None)))
        return decisions

    @staticmethod
    def feed_matchers_ahead(output, results) -> None:
        """Feed a step's tokens to the grammar matchers of its one-sample sequences now, in one parallel
        call, before the output processor appends them: `__call__` then reads each outcome instead of
        consuming the token again. The engine fills the next step's masks from the advanced matchers
        while the output processor runs. output: a SchedulerOutput; results: its SequenceResults."""
        if hasattr(results, "first_samples"):  # (the decode graph's results: one sample each, none built)
            firsts = results.first_samples()
        else:
            firsts = [result.samples[0] if result.samples else None for result in results]
        pairs = []
        for item, first in zip(output.scheduled, firsts):
            seq = item.seq
            if (seq.matcher is not None and item.num_samples == 1 and seq.status is not SequenceStatus.FINISHED
                    and seq.group.beam is None):
                pairs.append((seq.matcher, first.token_id))
        if pairs:
            from offline_paged.core.structured_matcher import advance_ahead  # llguidance: only where grammars run

            advance_ahead(pairs)

    def _detokenizer(self, seq: Sequence) -> IncrementalDetokenizer:
        if seq.detokenizer is None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.group.params.skip_special_tokens)
            seq.detokenizer.push(seq.output_token_ids[:-1])
        return seq.detokenizer

    def _find_stop_string(self, seq: Sequence) -> str | None:
        detokenizer = self._detokenizer(seq)
        piece = detokenizer.push([seq.token_ids[-1]])
        if not piece:
            return None
        text = detokenizer.text
        new_start = len(text) - len(piece)
        best: tuple[int, str] | None = None
        for stop in seq.group.params.stop:
            # A stop string may straddle the old text and the new piece.
            index = text.find(stop, max(0, new_start - len(stop) + 1))
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        keep = len(best[1]) if seq.group.params.include_stop_str_in_output else 0
        seq.text = text[:best[0] + keep]
        return best[1]

    def final_text(self, seq: Sequence) -> str:
        """The output text: cut before the stop string if one ended it, else all tokens decoded."""
        if seq.text is not None:
            return seq.text
        if not seq.group.params.detokenize:
            return ""
        skip = seq.group.params.skip_special_tokens
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=skip)
