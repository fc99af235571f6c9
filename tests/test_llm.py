"""LLM (entrypoints/llm.py), the vLLM-compatible surface: a script written as for vLLM runs; Logprob objects
carry the engine's numbers; vLLM arguments are accepted or refused by name; generation_config defaults;
use_tqdm and chat_template_kwargs. (The HF-style tokenizer against transformers': test_hf_tokenizer.py.)"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures_tiny_model import write_tiny_model

from offline_paged import LLM, BeamSearchParams, Logprob, SamplingParams, TokensPrompt

GREEDY = dict(temperature=0.0, ignore_eos=True)
SCRIPT = Path(__file__).parent / "scripts" / "vllm_style.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-vllm"), seed=5)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(str(model_dir), device="cpu", dtype="float64", block_size=4, num_kv_blocks=256)


def test_a_script_written_for_vllm_runs(model_dir):
    result = subprocess.run([sys.executable, str(SCRIPT), str(model_dir)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip().endswith("ok")


def test_logprob_objects_carry_the_engine_numbers_ranked_best_first(llm):
    params = SamplingParams(max_tokens=6, logprobs=4, prompt_logprobs=3, **GREEDY)
    [out] = llm.generate("ab cd", params, use_tqdm=False)
    engine = llm.llm_engine
    engine.add_request("raw", prompt="ab cd", params=params)
    raw = next(o for o in iter(engine.step, None) if o)[0]  # the engine's floats
    for objects, floats in zip(out.outputs[0].logprobs, raw.outputs[0].logprobs):
        assert {t: lp.logprob for t, lp in objects.items()} == floats
        ranked = sorted(objects.items(), key=lambda item: item[1].rank or 99)
        assert [lp.rank for _, lp in ranked[:4]] == [1, 2, 3, 4]
        assert [lp.logprob for _, lp in ranked[:4]] == sorted((lp.logprob for _, lp in ranked[:4]), reverse=True)
        assert all(isinstance(lp, Logprob) and lp.decoded_token == llm.get_tokenizer().decode([t])
                   for t, lp in objects.items())
    assert out.prompt_logprobs[0] is None
    for objects, floats in zip(out.prompt_logprobs[1:], raw.prompt_logprobs[1:]):
        assert {t: lp.logprob for t, lp in objects.items()} == floats


def test_detokenize_false_gives_ids_only(llm):
    [out] = llm.generate("ab", SamplingParams(max_tokens=4, logprobs=1, detokenize=False, **GREEDY),
                         use_tqdm=False)
    assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 4
    assert all(lp.decoded_token is None for step in out.outputs[0].logprobs for lp in step.values())


@pytest.mark.parametrize(("kwargs", "named"), [
    (dict(quantization="awq"), "quantization"), (dict(pipeline_parallel_size=2), "pipeline_parallel_size"),
    (dict(runner="draft"), "runner"), (dict(speculative_config={}), "speculative_config"),
    (dict(tokenizer="/elsewhere"), "tokenizer"),
])
def test_unsupported_llm_arguments_are_refused_by_name(model_dir, kwargs, named):
    with pytest.raises(ValueError, match=f"{named}.*not supported"):
        LLM(str(model_dir), device="cpu", **kwargs)


def test_harmless_vllm_arguments_are_accepted(model_dir):
    llm = LLM(str(model_dir), device="cpu", dtype="auto", enforce_eager=True, tensor_parallel_size=1,
              trust_remote_code=True, seed=None, disable_log_stats=True, kv_cache_memory_bytes=1 << 22,
              swap_space=0.25, runner="generate")
    assert llm.llm_engine.config.cuda_graphs is False and llm.llm_engine.config.kv_cache_memory == 1 << 22
    assert llm.llm_engine.config.swap_space == 1 << 28  # GiB, as in vLLM


def test_chat_takes_openai_text_content_parts(llm):
    plain = llm.chat([{"role": "user", "content": "ab cd"}], SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "ab "}, {"type": "text", "text": "cd"}]}],
                     SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    assert parts[0].prompt == plain[0].prompt and parts[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="image_url not supported"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_a_hub_id_and_revision_load_from_the_hf_cache(model_dir, tmp_path, monkeypatch):
    from fixtures_hf_cache import add_to_hf_cache

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = add_to_hf_cache(tmp_path / "hub", "TinyOrg/tiny", model_dir, commit="c" * 40, revision="v1")
    llm = LLM("TinyOrg/tiny", revision="v1", device="cpu", num_kv_blocks=64)
    assert llm.llm_engine.config.model == str(snapshot) and llm.model_name == "TinyOrg/tiny"
    assert llm.generate("ab", SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(FileNotFoundError, match="not in the Hugging Face cache"):
        LLM("TinyOrg/tiny", device="cpu")  # no refs/main


@pytest.mark.parametrize(("call", "named"), [
    (lambda llm: llm.generate("a", lora_request=object()), "lora_request"),
    (lambda llm: llm.generate({"prompt": "a", "multi_modal_data": {}}), "multi_modal_data"),
    (lambda llm: llm.chat([{"role": "user", "content": "a"}], tools=[{}]), "tools"),
    (lambda llm: llm.beam_search(["a"], BeamSearchParams(beam_width=2, max_tokens=2), lora_request=1), "lora_request"),
])
def test_unsupported_call_arguments_are_refused_by_name(llm, call, named):
    with pytest.raises(ValueError, match=f"{named}.*not supported"):
        call(llm)


def test_generation_config_gives_the_defaults_vllm_applies(tmp_path):
    model_dir = write_tiny_model(tmp_path / "m", seed=5)
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 3, "do_sample": True}))
    llm = LLM(str(model_dir), device="cpu")
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (0.6, 0.9, 20, 3)
    assert all(len(c.token_ids) <= 3 for o in llm.generate(["a", "b"], use_tqdm=False) for c in o.outputs)
    assert LLM(str(model_dir), device="cpu", generation_config="vllm").get_default_sampling_params() == SamplingParams()


def test_beam_search_api_equals_the_sampling_params_route(llm):
    [beams] = llm.beam_search([TokensPrompt(prompt_token_ids=[97, 98, 99])], BeamSearchParams(beam_width=3, max_tokens=5))
    [route] = llm.generate([[97, 98, 99]], SamplingParams(use_beam_search=True, n=3, best_of=3, temperature=0.0,
                                                          max_tokens=5), use_tqdm=False)
    assert [s.tokens for s in beams.sequences] == [[97, 98, 99] + c.token_ids for c in route.outputs]
    assert [s.cum_logprob for s in beams.sequences] == pytest.approx([c.cumulative_logprob for c in route.outputs])


def test_beam_search_with_a_grammar_returns_distinct_allowed_beams(llm):
    choices = ["cat", "cow", "dog", "cod"]
    [beams] = llm.beam_search(["Pet: "], BeamSearchParams(beam_width=3, max_tokens=8,
                                                          structured_outputs={"choice": choices}))
    texts = [s.text for s in beams.sequences]
    assert len(texts) == 3 and len(set(texts)) == 3 and set(texts) <= set(choices)


def test_use_tqdm_drives_the_given_bar_once_per_prompt(llm):
    updates = []

    class Bar:
        def __init__(self, total, **_):
            updates.append(("total", total))

        def update(self, n):
            updates.append(("update", n))

        def set_postfix_str(self, *_, **__):
            pass

        def close(self):
            updates.append(("close", None))

    llm.generate(["a", "b", "c"], SamplingParams(max_tokens=2), use_tqdm=Bar)
    assert updates == [("total", 3)] + [("update", 1)] * 3 + [("close", None)]


def test_chat_template_kwargs_reach_the_template(llm):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if shout %}!!{% endif %}"
    [plain, loud] = [llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1),
                              use_tqdm=False, chat_template=template, chat_template_kwargs=kwargs)[0]
                     for kwargs in ({}, {"shout": True})]
    assert (plain.prompt, loud.prompt) == ("hi", "hi!!")


# ----------------------------------------------------------------------------- text prompts tokenised in one batch
TEXTS = ["The sky is", "Hello there, how are you today?", "a", "Zebra crossings " * 5]


def test_text_prompts_tokenised_in_one_batch_give_what_one_by_one_gives(llm, monkeypatch):
    """generate() of several texts tokenises them in one encode_batch call; the ids, and so the tokens, are those
    of each text added alone (a single prompt takes add_request's own encode)."""
    params = SamplingParams(max_tokens=5, **GREEDY)
    batches = []
    encode_batch = llm.engine.tokenizer.encode_batch
    monkeypatch.setattr(llm.engine.tokenizer, "encode_batch", lambda texts, **kw: batches.append(texts) or
                        encode_batch(texts, **kw))
    together = llm.generate(TEXTS, params, use_tqdm=False)
    assert batches == [TEXTS]
    monkeypatch.undo()
    alone = [llm.generate(text, params, use_tqdm=False)[0] for text in TEXTS]
    tokenizer = llm.engine.tokenizer
    for text, got, want in zip(TEXTS, together, alone):
        assert got.prompt == text and got.prompt_token_ids == tokenizer.encode(text) == want.prompt_token_ids
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert tokenizer.encode_batch(TEXTS, add_special_tokens=False) == [
        tokenizer.encode(text, add_special_tokens=False) for text in TEXTS]


def test_chat_conversations_tokenised_in_one_batch_give_what_one_by_one_gives(llm):
    conversations = [[{"role": "user", "content": text}] for text in TEXTS]
    params = SamplingParams(max_tokens=4, **GREEDY)
    together = llm.chat(conversations, params, use_tqdm=False)
    alone = [llm.chat(conversation, params, use_tqdm=False)[0] for conversation in conversations]
    assert [o.prompt_token_ids for o in together] == [o.prompt_token_ids for o in alone]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]


def test_a_text_the_tokenizer_panics_on_is_named_by_its_prompt_index(model_dir, tmp_path):
    """A tokenizer that panics on one text: the batch fails, each text is then added alone, and the error names
    prompt 2 (the first two were added and are withdrawn)."""
    import shutil

    from fixtures_tiny_model import PANIC_TEXT, make_tokenizer_panic

    model = Path(shutil.copytree(model_dir, tmp_path / "model"))
    make_tokenizer_panic(model)
    hostile = LLM(str(model), device="cpu", dtype="float64", block_size=4, num_kv_blocks=64)
    with pytest.raises(ValueError, match="one of these texts"):
        hostile.engine.tokenizer.encode_batch(["fine", PANIC_TEXT])
    with pytest.raises(ValueError, match=r"prompt 2: the tokenizer failed on this text"):
        hostile.generate(["fine", "also fine", PANIC_TEXT, "never added"], SamplingParams(max_tokens=2))
    assert not hostile.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match=r"the tokenizer failed on this text"):
        hostile.chat([[{"role": "user", "content": "fine"}], [{"role": "user", "content": PANIC_TEXT}]],
                      SamplingParams(max_tokens=2))


def test_the_llm_adds_bench_runs_both_ways(model_dir, monkeypatch, capsys):
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_llm_adds.py"
    monkeypatch.syspath_prepend(str(path.parent))  # as `python benchmarks/bench_llm_adds.py` has it
    spec = importlib.util.spec_from_file_location("bench_llm_adds", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr("sys.argv", ["bench_llm_adds.py", str(model_dir), "--num-prompts", "6", "--words", "4",
                                     "--repeat", "1"])
    module.main()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(",")[1].split()[0] for line in lines[:2]] == ["one", "batched"]
    assert len(lines) == 4 and all("ms" in line for line in lines)
