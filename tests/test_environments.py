"""The environment room: the calculator tool, episode limits and end reasons, building an environment by name or
dotted path with its options checked, and the built-in environments driven turn by turn."""

from __future__ import annotations

import sys
import textwrap
import time

import pytest

from megatron_rl.environments import (CalculatorEnv, Episode, EpisodeLimits, PythonMathEnv, StepResult,
                                      build_environment)
from megatron_rl.environments.tools import calculate
from megatron_rl.spec.errors import ConfigError


@pytest.mark.parametrize("expression, value", [
    ("37*58", "2146"), ("2 + 3 * 4", "14"), ("(2 + 3) * 4", "20"), ("7 / 2", "3.5"), ("7 // 2", "3"),
    ("-7 % 3", "2"), ("2^10", "1024"), ("1/3", "0.3333333333"), ("6 × 7", "42"), ("84 ÷ 2", "42"),
    ("0.1 + 0.2", "0.3"), ("1e3", "1000"),
])
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, error", [
    ("__import__('os').system('id')", "only numbers"), ("open('/etc/passwd')", "only numbers"),
    ("9**9**9", "too large"), ("10**400", "too large"), ("1/0", "division by zero"), ("(-8) ** 0.5", "not a real"),
    ("2 +", "not an arithmetic expression"), ("", "empty"), ("1+" * 150 + "1", "longer than"), ("x * 2", "only"),
])
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(expression, error):
    started = time.monotonic()
    result = calculate(expression)
    assert result.startswith("error:") and error in result
    assert time.monotonic() - started < 1.0


def test_a_calculator_episode_calls_the_tool_then_answers():
    episode = Episode(build_environment("calculator", {"tag": "c"})(), EpisodeLimits())
    assert episode.start({"prompt": "37*58=", "answer": 2146}) == [
        {"role": "user", "content": "37*58="}]
    assert episode.env.stop == ("</c>",)
    assert episode.advance("<c>37*58</c>", tokens=11) == [{"role": "tool", "content": "2146"}]
    assert episode.advance("2146", tokens=4) is None
    assert (episode.end_reason, episode.reward, len(episode.turns)) == ("done", 1.0, 2)
    assert episode.log()["turns"][0]["info"] == {"tool_calls": 1}

    wrong = Episode(CalculatorEnv(), EpisodeLimits())
    wrong.start({"prompt": "37*58=", "answer": 2146})
    assert wrong.advance("2000", tokens=4) is None
    assert (wrong.end_reason, wrong.reward) == ("done", 0.0)


def test_each_limit_ends_an_episode_with_its_reason():
    record = {"prompt": "1+1=", "answer": 2}
    calls = "<calc>1+1</calc>"

    def episode(**limits):
        run = Episode(CalculatorEnv(max_calls=10), EpisodeLimits(**limits))
        run.start(record)
        run.count_prompt(4)
        return run

    turns = episode(max_turns=2)
    assert turns.advance(calls, tokens=8) is not None
    assert turns.advance(calls, tokens=8) is None and turns.end_reason == "max_turns"

    long_turn = episode(max_turn_tokens=8)
    assert long_turn.advance("1111111111", tokens=8, cut="turn") is None
    assert long_turn.end_reason == "turn_tokens" and long_turn.turns[-1].reward == 0.0

    long_episode = episode(max_episode_tokens=20)
    assert long_episode.advance(calls, tokens=8) is not None
    assert long_episode.count_reply(4) is True
    assert long_episode.advance(calls, tokens=8) is not None
    assert long_episode.count_reply(4) is False and long_episode.end_reason == "episode_tokens"
    assert [t.get("reply_fed", True) for t in long_episode.log()["turns"]] == [True, False]
    with pytest.raises(RuntimeError, match="has ended"):
        long_episode.advance("2", tokens=1)


class _Slow:
    stop = ("</x>",)

    def reset(self, record):
        return [{"role": "user", "content": "hi"}]

    def step(self, text):
        if text == "raise":
            raise KeyError("missing field")
        if text == "silent":
            return None, 0.5, False, {}
        time.sleep(5)
        return StepResult([{"role": "user", "content": "late"}])


def test_a_slow_step_times_out_and_a_failing_one_ends_only_its_episode():
    slow = Episode(_Slow(), EpisodeLimits(step_timeout_s=0.2))
    slow.start({})
    started = time.monotonic()
    assert slow.advance("wait", tokens=1) is None
    assert slow.end_reason == "step_timeout" and time.monotonic() - started < 2.0

    broken = Episode(_Slow(), EpisodeLimits())
    broken.start({})
    assert broken.advance("raise", tokens=1) is None
    assert broken.end_reason == "env_error" and broken.log()["error"] == "KeyError: 'missing field'"

    silent = Episode(_Slow(), EpisodeLimits(), bounded=False)
    silent.start({})
    assert silent.advance("silent", tokens=1) is None
    assert (silent.end_reason, silent.reward) == ("no_reply", 0.5)


@pytest.fixture
def user_envs(tmp_path, monkeypatch):
    (tmp_path / "userenvs.py").write_text(textwrap.dedent("""
        class Echo:
            stop = ("\\n",)
            def __init__(self, *, times=1):
                self.times = times
            def reset(self, record):
                return [{"role": "user", "content": record["prompt"]}]
            def step(self, text):
                return [{"role": "user", "content": text * self.times}], 0.0, False, {}

        class NoStep:
            stop = ()
            def reset(self, record):
                return []

        class BadStop:
            stop = "</a>"
            def reset(self, record):
                return []
            def step(self, text):
                return None, 0.0, True, {}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("userenvs", None)


def test_an_environment_is_built_by_dotted_path_with_its_options_checked(user_envs):
    make = build_environment("userenvs:Echo", {"times": 2})
    first, second = make(), make()
    assert first is not second
    first.reset({"prompt": "a"})
    assert first.step("ab") == ([{"role": "user", "content": "abab"}], 0.0, False, {})


@pytest.mark.parametrize("name, options, message", [
    ("calculater", {}, "not built in (calculator, python_math) (did you mean 'calculator'?); or give a dotted path"),
    ("calculator", {"tags": "c"}, "unknown option tags (did you mean 'tag'?); valid options: tag, max_calls"),
    ("calculator", {"tag": "c d"}, "environment 'calculator': calculator tag 'c d'"),
    ("python_math", {"max_calls": 0}, "PythonMathEnv max_calls must be at least 1"),
    ("userenvs:Echo", {"time": 2}, "unknown option time"),
    ("userenvs:NoStep", {}, "needs reset(record) and step(text) methods"),
    ("userenvs:BadStop", {}, "stop is '</a>'"),
    ("userenvs:Missing", {}, "environment 'userenvs:Missing': 'userenvs' has no attribute 'Missing'"),
    ("nosuchpkg.envs:Env", {}, "environment 'nosuchpkg.envs:Env': module 'nosuchpkg.envs' not found"),
])
def test_a_bad_environment_is_one_line_naming_it(user_envs, name, options, message):
    with pytest.raises(ConfigError) as error:
        build_environment(name, options)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_python_math_runs_the_code_in_the_sandbox_and_scores_the_boxed_answer():
    episode = Episode(PythonMathEnv(wall_s=5.0), EpisodeLimits())
    episode.start({"prompt": "What is 2^10 + 7?", "answer": "1031"})
    reply = episode.advance("Let me compute.\n<python>print(2**10 + 7)</python>", tokens=30)
    assert reply == [{"role": "tool", "content": "1031"}]
    assert episode.advance("So the answer is \\boxed{1031}.", tokens=12) is None
    assert (episode.end_reason, episode.reward) == ("done", 1.0)

    hostile = Episode(PythonMathEnv(wall_s=1.0, cpu_s=1), EpisodeLimits())
    hostile.start({"prompt": "loop", "answer": "1"})
    reply = hostile.advance("<python>while True: pass</python>", tokens=20)
    assert reply is not None and reply[0]["content"] in ("[timed out]", "[killed: out of CPU time or memory]")


def test_the_launch_table_of_built_in_options_is_each_class_s_keywords():
    import inspect

    from megatron_rl.environments import BUILTIN_ENVIRONMENTS
    from megatron_rl.spec.environments import BUILTIN_ENVIRONMENT_OPTIONS

    assert set(BUILTIN_ENVIRONMENT_OPTIONS) == set(BUILTIN_ENVIRONMENTS)
    for name, cls in BUILTIN_ENVIRONMENTS.items():
        keywords = [p.name for p in inspect.signature(cls).parameters.values() if p.kind is p.KEYWORD_ONLY]
        assert BUILTIN_ENVIRONMENT_OPTIONS[name] == tuple(keywords), name
