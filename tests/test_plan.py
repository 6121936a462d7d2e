"""A request's plan (runtime/plan.py): the option rule lives in one place and every front end reports its SpecError
under the same neutral name (whiflash-run as its flag, the OpenAI server as a 400's `param`, the Triton model as an
error response); and a request's router and drafters are built once, whichever front end it comes through."""
from __future__ import annotations

import re
import sys
import threading
import types

import numpy as np
import pytest

from whiflash_trt import cli
from whiflash_trt.config import GenerationConfig, SpecConfig
from whiflash_trt.errors import SpecError
from whiflash_trt.runtime.engine import Engine
from whiflash_trt.runtime.plan import PARAMS, check_options_apply
from whiflash_trt.serving.openai_api.limits import ServerLimits
from whiflash_trt.serving.openai_api.protocol import APIError, parse_completion
from whiflash_trt.serving.scheduler import BatchScheduler, Request

SERVED = "tiny"
# (the settings a request names, the neutral name of the one at fault): the three every front end takes
IGNORED = [({"mode": "ar", "router": "entropy"}, "router"),
           ({"mode": "eagle3", "threshold": 0.5}, "threshold"),
           ({"mode": "dflash", "router": "neural", "threshold": 1.0}, "router")]


@pytest.fixture
def triton_model(monkeypatch):
    """serving/triton_model.py imported over a stand-in for Triton's `triton_python_backend_utils` that reads a
    request's inputs from a dict (name -> value), as the Python backend hands them over: [1, 1] tensors."""
    pb_utils = types.ModuleType("triton_python_backend_utils")
    pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class Tensor:
        def __init__(self, value) -> None:
            self.value = value

        def as_numpy(self):
            value = self.value.encode() if isinstance(self.value, str) else self.value
            return np.array([[value]], dtype=object if isinstance(value, bytes) else None)

    pb_utils.get_input_tensor_by_name = lambda request, name: Tensor(request[name]) if name in request else None
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb_utils)
    monkeypatch.delitem(sys.modules, "whiflash_trt.serving.triton_model", raising=False)
    import whiflash_trt.serving.triton_model as model

    return model


def cli_error(capsys, engine_dir, settings: dict) -> str:
    argv = ["--engine", str(engine_dir), "--prompt", "hi", "--threads", "1", "--max-new-tokens", "2"]
    for name, value in settings.items():
        argv += [f"--{name}", str(value)]
    assert cli.run_main(argv) == 2
    return capsys.readouterr().err.strip()


def openai_error(engine, settings: dict) -> APIError:
    body = {"model": SERVED, "prompt": "hi", "max_tokens": 2, **settings}
    with pytest.raises(APIError) as raised:
        parse_completion(body, engine, SERVED, ServerLimits())
    assert raised.value.status == 400
    return raised.value


@pytest.mark.parametrize("settings, param", IGNORED, ids=[p for _, p in IGNORED])
def test_a_setting_the_mode_ignores_is_the_same_param_from_every_front_end(capsys, spec_engine, spec_engine_dir,
                                                                            triton_model, settings, param):
    with pytest.raises(SpecError) as raised:
        triton_model._plan(settings, spec_engine)
    assert raised.value.param == param
    assert openai_error(spec_engine, settings).param == param
    assert re.match(f"error: --{param}[ ,]", cli_error(capsys, spec_engine_dir, settings))


def test_a_mode_without_its_drafter_is_param_mode_from_every_front_end(capsys, tiny_engine, triton_model):
    engine_dir = tiny_engine()   # the target alone
    engine = Engine.load(engine_dir)
    with pytest.raises(SpecError) as raised:
        triton_model._plan({"mode": "eagle3"}, engine)
    assert raised.value.param == "mode" and str(raised.value).startswith("mode eagle3 needs the eagle3 drafter")
    error = openai_error(engine, {"mode": "eagle3"})
    assert error.param == "mode" and error.message == str(raised.value)
    assert cli_error(capsys, engine_dir, {"mode": "eagle3"}).startswith("error: --mode eagle3 needs the eagle3 drafter")


def test_the_option_rule_names_every_ignored_setting_neutrally_and_each_front_end_spells_it():
    with pytest.raises(SpecError) as raised:
        check_options_apply("dflash", {"tree_min_prob", "tree_top_k"})
    e = raised.value
    assert e.params == ("tree_top_k", "tree_min_prob") and e.param == "tree_top_k"
    assert str(e) == "tree_top_k, tree_min_prob apply only to the EAGLE-3 drafter; this request's mode is dflash"
    assert e.spelled(cli._flag).startswith("--tree-top-k, --tree-min-prob apply only")
    check_options_apply("whiflash", PARAMS)   # whiflash drafts with both: every setting applies
    with pytest.raises(ValueError, match="not speculation settings: top_p"):
        check_options_apply("ar", {"top_p"})


class RouterCount:
    """Engine.router_for and Engine.proposers_for, the real ones, with their calls counted."""

    def __init__(self, monkeypatch) -> None:
        self.routers = self.proposers = 0
        router_for, proposers_for = Engine.router_for, Engine.proposers_for

        def counted_router_for(engine, spec):
            self.routers += 1
            return router_for(engine, spec)

        def counted_proposers_for(engine, spec):
            self.proposers += 1
            return proposers_for(engine, spec)

        monkeypatch.setattr(Engine, "router_for", counted_router_for)
        monkeypatch.setattr(Engine, "proposers_for", counted_proposers_for)


class Finished:
    """A RequestSink that waits for the end."""

    def __init__(self) -> None:
        self.done, self.result, self.error = threading.Event(), None, None

    def tokens(self, new_ids) -> None:
        pass

    def finished(self, result) -> None:
        self.result = result
        self.done.set()

    def failed(self, error) -> None:
        self.error = error
        self.done.set()

    def cancelled(self) -> None:
        self.done.set()


def run_scheduled(engine, prompt_ids, gen, spec) -> Finished:
    scheduler, sink = BatchScheduler(engine, 1, 1), Finished()
    scheduler.start()
    try:
        scheduler.submit(Request(prompt_ids, gen, spec, sink))
        assert sink.done.wait(120)
    finally:
        scheduler.close()
    assert sink.error is None and sink.result.stats["mode"] == "whiflash"
    return sink


def test_an_openai_request_builds_its_router_and_drafters_once(monkeypatch, spec_engine):
    count = RouterCount(monkeypatch)
    body = {"model": SERVED, "prompt": "abc def", "max_tokens": 6, "temperature": 0, "mode": "whiflash"}
    parsed = parse_completion(body, spec_engine, SERVED, ServerLimits())
    run_scheduled(spec_engine, parsed.prompt_ids, parsed.gen, parsed.plan)
    assert (count.routers, count.proposers) == (1, 1)


def test_a_triton_request_builds_its_router_and_drafters_once(monkeypatch, spec_engine, triton_model):
    count = RouterCount(monkeypatch)
    plan = triton_model._plan({"mode": "whiflash", "router": "entropy"}, spec_engine)
    run_scheduled(spec_engine, spec_engine.encode("abc def"), GenerationConfig(max_new_tokens=6), plan)
    assert (count.routers, count.proposers) == (1, 1)


def test_whiflash_run_builds_one_router_per_prompt(monkeypatch, capsys, tmp_path, spec_engine_dir):
    count = RouterCount(monkeypatch)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"prompt": "abc def"}\n')
    argv = ["--engine", str(spec_engine_dir), "--prompts-file", str(prompts), "--threads", "1",
            "--max-new-tokens", "4", "--mode", "whiflash", "--json"]
    assert cli.run_main(argv) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    assert (count.routers, count.proposers) == (2, 2)


def test_generate_from_a_spec_plans_once_and_a_plan_is_used_as_it_is(monkeypatch, spec_engine):
    count = RouterCount(monkeypatch)
    gen, spec = GenerationConfig(max_new_tokens=6), SpecConfig(mode="whiflash", router="entropy")
    by_spec = spec_engine.generate([1, 2, 3], gen, spec=spec)
    assert (count.routers, count.proposers) == (1, 1)
    plan = spec_engine.plan(spec)
    by_plan = spec_engine.generate([1, 2, 3], gen, spec=plan)
    assert (count.routers, count.proposers) == (2, 2) and by_plan.token_ids == by_spec.token_ids
