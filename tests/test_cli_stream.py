"""`whiflash-run --stream`: the streamed text is the final text; a stop string never reaches the screen."""
from __future__ import annotations

from whiflash_trt.cli import run_main


def _run(capsys, engine, *extra: str) -> str:
    capsys.readouterr()
    assert run_main(["--engine", str(engine), "--prompt", "def add(a, b):", "--max-new-tokens", "40",
                     "--mode", "ar", *extra]) == 0
    return capsys.readouterr().out


def test_streamed_text_equals_the_final_text_and_stops_before_the_stop_string(capsys, tiny_engine):
    engine = tiny_engine()
    full = _run(capsys, engine)
    assert _run(capsys, engine, "--stream") == full
    text = full.rstrip("\n")
    assert len(text) > 12, "the tiny model should produce some text"
    stop = text[8:11]
    expected = text[:text.find(stop)] + "\n"
    assert _run(capsys, engine, "--stop", stop) == expected
    assert _run(capsys, engine, "--stop", stop, "--stream") == expected
