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


# ------------------------------------------------------------------------------------------------ episode journal
class _Counted:
    """An environment that counts its own calls (state kept across a resume through the journal's pickle) and
    records every call in a shared list (the side effects)."""

    stop = ("</c>",)
    made: list = []

    def __init__(self) -> None:
        self.calls = 0

    def reset(self, record):
        self.made.append(("reset", record["prompt"]))
        return [{"role": "user", "content": record["prompt"]}]

    def step(self, text):
        self.calls += 1
        self.made.append(("step", text))
        return [{"role": "tool", "content": f"call {self.calls}"}], 0.5, False, {"calls": self.calls}


def _episode(journal, index=0):
    from megatron_rl.environments import Episode, EpisodeLimits

    return Episode(_Counted(), EpisodeLimits(max_turns=4), bounded=False, journal=journal, index=index)


def test_a_journal_replays_the_calls_made_before_and_makes_the_rest(tmp_path):
    from megatron_rl.environments.journal import EpisodeJournal, prune_journals

    path = tmp_path / "episodes" / "step_00000002_draw0_rank0.jsonl"
    _Counted.made = []
    first = _episode(EpisodeJournal(path))
    assert first.start({"prompt": "2*3"}) == [{"role": "user", "content": "2*3"}]
    assert first.advance("<c>2*3</c>", tokens=3) == [{"role": "tool", "content": "call 1"}]
    made = list(_Counted.made)
    assert made == [("reset", "2*3"), ("step", "<c>2*3</c>")]
    # the process is killed here; the resumed step makes the same calls, then one more
    journal = EpisodeJournal(path)
    again = _episode(journal)
    assert again.start({"prompt": "2*3"}) == [{"role": "user", "content": "2*3"}]
    assert again.advance("<c>2*3</c>", tokens=3) == [{"role": "tool", "content": "call 1"}]
    assert _Counted.made == made and journal.replayed == 2  # answered from the journal, not made again
    assert again.advance("<c>6+1</c>", tokens=3) == [{"role": "tool", "content": "call 2"}]  # its state came back
    assert _Counted.made == [*made, ("step", "<c>6+1</c>")] and again.reward == 1.0
    # a turn that differs from the journal's is made for real, from the state before it, and the older entries
    # from that turn on are dropped for good (a third attempt replays the new one)
    journal = EpisodeJournal(path)
    other = _episode(journal)
    other.start({"prompt": "2*3"})
    assert other.advance("<c>9*9</c>", tokens=3) == [{"role": "tool", "content": "call 1"}]
    assert _Counted.made[-1] == ("step", "<c>9*9</c>")
    third = EpisodeJournal(path)
    assert sorted(third.entries[0]) == [0, 1] and third.entries[0][1]["text"] == "<c>9*9</c>"
    third.close()
    prune_journals(tmp_path, upto=1)
    assert path.exists()
    prune_journals(tmp_path, upto=2)
    assert not path.exists()


def test_a_journal_line_cut_by_the_kill_is_ignored(tmp_path):
    from megatron_rl.environments.journal import EpisodeJournal

    path = tmp_path / "j.jsonl"
    journal = EpisodeJournal(path)
    episode = _episode(journal)
    episode.start({"prompt": "1+1"})
    episode.advance("<c>1+1</c>", tokens=3)
    journal.close()
    text = path.read_text()
    path.write_text(text[:-20])  # the last line cut short
    assert sorted(EpisodeJournal(path).entries[0]) == [0]
    assert oct(path.stat().st_mode & 0o777) == "0o600"
