"""Rule-based verifiers (the math checker on both backends), reward registry, dotted-path loading, weighted
combination, and algorithm.rewards entries with options.

Run: `.venv/bin/python -m pytest tests/test_rewards.py -q`
"""

import re
import sys
import textwrap

import pytest

from megatron_rl.spec.config.loader import load_config
from megatron_rl.spec.errors import ConfigError
from megatron_rl.rewards import (
    MathVerifyReward,
    WeightedRewards,
    build_reward_fn,
    combine_rewards,
    extract_boxed,
    extract_last_number,
    format_reward,
    load_reward_fn,
    math_answer_reward,
    overlong_penalty,
    parse_number,
    register_reward,
    registered_rewards,
    score_completions,
)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces kept whole
        (r"\boxed{a{b{c}}d}", "a{b{c}}d"),
        (r"first \boxed{1} then \boxed{2}", "2"),  # the last box wins
        (r"\boxed{3} and a truncated \boxed{4", "3"),  # an unbalanced last box falls back to a complete one
        (r"\boxed 5$", "5"),
        (r"\fbox{7}", "7"),
        ("no box here", None),
    ],
)
def test_extract_boxed(text, want):
    assert extract_boxed(text) == want


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("The answer is 1,234.", 1234.0),
        ("total: 1,234,567 apples", 1234567.0),
        ("it is -7", -7.0),
        ("5-3", 3.0),  # a minus after a digit is an operator, not a sign
        ("about 2.5 then .25", 0.25),
        ("3/4 of the cake", 0.75),
        ("-1/4", -0.25),
        ("lists 3,4,5", 5.0),  # comma groups need 3 digits, so this is a list
        ("approx 12.", 12.0),  # a final full stop is not a decimal point
        ("x2 has no standalone number", None),
        ("1/0 and nothing else", None),
        ("nothing", None),
    ],
)
def test_extract_last_number(text, want):
    assert extract_last_number(text) == want


@pytest.mark.parametrize(
    ("text", "want"),
    [(r"\frac{3}{4}", 0.75), (r"-\dfrac{1}{2}", -0.5), ("$1,234$", 1234.0), ("12.", 12.0), ("5 apples", None)],
)
def test_parse_number(text, want):
    assert parse_number(text) == want


MATH_CASES = [
        (r"... so \boxed{72}", "72", 1.0),
        (r"... so \boxed{72.0}", 72, 1.0),  # numeric match
        (r"\boxed{1,234}", "1234", 1.0),
        (r"\boxed{\frac{3}{4}}", "0.75", 1.0),
        (r"\boxed{0.3333}", "1/3", 0.0),  # no rounding tolerance
        (r"I think 72 but \boxed{71}", "72", 0.0),  # the box is the answer, not the last number
        ("Adding gives 7 + 5 = 12", "12", 1.0),  # no box: last number
        ("Adding gives 12 then 13", "12", 0.0),
        ("Natalia sold 72 clips", "She sold 48/2 = 24 in May.\n#### 72", 1.0),  # GSM8K reference
        (r"\boxed{B}", "B", 1.0),  # non-numeric exact match
        (r"\boxed{\text{B}}", "b", 1.0),
        ("<answer>-5</answer>", -5, 1.0),
        ("no number at all", "3", 0.0),
        ("Paris", "paris", 1.0),  # non-numeric, no box: whole completion
]
ARABIC_CASES = [  # Arabic-script numerals: by value, in the box, the answer tag, running text and the reference
        (r"\boxed{٣٫٥}", "3.5", 1.0),  # Arabic-Indic digits, Arabic decimal separator
        (r"\boxed{٣٫٥}", 3.5, 1.0),
        (r"\boxed{٣٫٦}", "3.5", 0.0),
        (r"\boxed{١٬٢٣٤}", "1234", 1.0),  # Arabic thousands separator
        (r"\boxed{۴۲}", "42", 1.0),  # Extended Arabic-Indic (Persian, Urdu) digits
        (r"\boxed{-٧}", -7, 1.0),
        (r"\boxed{\frac{٣}{٤}}", "0.75", 1.0),
        ("<answer>\u200f٤٢\u200f</answer>", "42", 1.0),  # right-to-left marks around the number
        ("إذن الجواب هو ٤٢", "42", 1.0),  # no box: the last number of Arabic text
        ("إذن الجواب هو ٤٣", "42", 0.0),
        (r"\boxed{42}", "الجواب: ٤٢ #### ٤٢", 1.0),  # an Arabic GSM8K-style reference
        (r"\boxed{٢٫٥}", "5/2", 1.0),
]
SYMBOLIC_CASES = [(r"\boxed{x^2+2x+1}", "(x+1)^2"), (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}"),
                  (r"\boxed{\{1, 2\}}", r"\{2, 1\}")]


@pytest.mark.parametrize(("completion", "answer", "want"), MATH_CASES + ARABIC_CASES)
def test_math_answer_reward(completion, answer, want):
    assert math_answer_reward(completion, answer) == want


@pytest.fixture(params=["builtin", "math_verify"])
def math_backend(request):
    if request.param == "math_verify":
        pytest.importorskip("math_verify")
    return request.param


@pytest.mark.parametrize(("completion", "answer", "want"), MATH_CASES + ARABIC_CASES)
def test_math_verify_reward_on_both_backends(math_backend, completion, answer, want):
    reward = MathVerifyReward(backend=math_backend)
    assert reward.backend == math_backend  # builtin is used even when math-verify is installed
    assert reward(["p"], [completion], [answer]) == [want]


def test_math_tolerance_and_symbolic_answers(math_backend):
    loose = MathVerifyReward(backend=math_backend, tolerance=1e-3)
    assert loose(["p", "p"], [r"\boxed{0.3333}", r"\boxed{0.33}"], ["1/3", "1/3"]) == [1.0, 0.0]
    symbolic = MathVerifyReward(backend=math_backend)(["p"] * 3, *map(list, zip(*SYMBOLIC_CASES)))
    assert symbolic == ([1.0] * 3 if math_backend == "math_verify" else [0.0] * 3)  # equal forms need math-verify
    with pytest.raises(ConfigError, match="tolerance=-1"):
        MathVerifyReward(backend=math_backend, tolerance=-1)


def test_math_verify_falls_back_without_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify now raises ImportError
    assert build_reward_fn("math_verify").backend == "builtin"
    with pytest.raises(ConfigError, match=r"pip install 'megatron-rl\[math\]'"):
        build_reward_fn("math_verify", {"backend": "math_verify"})
    with pytest.raises(ConfigError, match="backend='sympy' is not one of auto, math_verify, builtin"):
        build_reward_fn("math_verify", {"backend": "sympy"})


def test_format_reward():
    pattern = r"<think>.*?</think>\s*<answer>.*?</answer>"
    assert format_reward("<think>a\nb</think> <answer>3</answer>", pattern=pattern) == 1.0
    assert format_reward("<answer>3</answer>", pattern=pattern) == 0.0
    tags = ["think", "answer"]
    assert format_reward("<think>x</think><answer>3</answer>", required_tags=tags) == 1.0
    assert format_reward("<answer>3</answer><think>x</think>", required_tags=tags) == 0.0  # wrong order
    assert format_reward("<think>x</think><think>y</think><answer>3</answer>", required_tags=tags) == 0.0
    assert format_reward(r"so \boxed{3}") == 1.0 and format_reward("so 3") == 0.0  # default: needs a box


def test_overlong_penalty():
    # max 20, buffer 5: free up to 15, then -(len - 15)/5, -1 beyond 20.
    assert overlong_penalty([10, 15, 17, 20, 25], max_len=20, buffer_len=5) == [0.0, 0.0, -0.4, -1.0, -1.0]
    with pytest.raises(ConfigError, match="buffer_len"):
        overlong_penalty([1], max_len=4, buffer_len=8)


def test_registry_builds_named_rewards():
    assert {"math", "format", "exact"} <= set(registered_rewards())
    math_fn = build_reward_fn("math")
    assert math_fn(["p", "p"], [r"\boxed{2}", "1"], ["2", "2"]) == [1.0, 0.0]
    fmt = build_reward_fn("format", {"required_tags": ["answer"]})
    assert fmt(["p"], ["<answer>1</answer>"], [None]) == [1.0]
    with pytest.raises(ConfigError, match="reward 'format': unknown option tags; valid options: pattern, required_tags"):
        build_reward_fn("format", {"tags": ["answer"]})
    with pytest.raises(ConfigError, match="not registered"):
        build_reward_fn("nope")


def test_the_specs_builtin_reward_options_are_their_scorers_keywords():
    """The config check (torch-free spec) and the job's scorers agree on every built-in's options."""
    import inspect

    from megatron_rl.rewards.registry import _FACTORIES
    from megatron_rl.spec.rewards import BUILTIN_REWARD_OPTIONS

    for name, options in BUILTIN_REWARD_OPTIONS.items():
        params = inspect.signature(_FACTORIES[name]).parameters.values()
        assert tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY) == options, name
        assert all(p.default is not p.empty for p in params), name


def test_registry_accepts_stateful_scorers():
    class LengthScorer:  # stands for a reward model: state built once, then called batched
        def __init__(self, scale):
            self.scale = scale

        def __call__(self, prompts, completions, answers):
            return [self.scale * len(c) for c in completions]

    register_reward("test-length", LengthScorer, replace=True)
    assert build_reward_fn("test-length", {"scale": 0.5})(["p"], ["abcd"], [None]) == [2.0]
    scorer = LengthScorer(1.0)
    assert build_reward_fn(scorer) is scorer
    with pytest.raises(ValueError, match="already registered"):
        register_reward("math", LengthScorer)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    package = tmp_path / "userrewards"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "fns.py").write_text(
        textwrap.dedent(
            """
            NOT_CALLABLE = 3

            def contains_answer(prompts, completions, answers):
                return [1.0 if str(a) in c else 0.0 for c, a in zip(completions, answers)]

            class Holder:
                @staticmethod
                def half(prompts, completions, answers):
                    return [0.5] * len(completions)

            def make_const(value):
                return lambda prompts, completions, answers: [value] * len(completions)

            def wrong_count(prompts, completions, answers):
                return [1.0]

            def divides(prompts, completions, answers):
                return [1.0 / len(c) for c in completions]  # an empty completion raises

            def nan_on_b(prompts, completions, answers):
                return [float("nan") if c == "b" else 1.0 for c in completions]

            def unreachable(prompts, completions, answers):
                raise ConnectionError("the judge is unreachable")
            """
        )
    )
    (package / "broken.py").write_text("import definitely_missing_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "userrewards"


def test_load_reward_fn_by_dotted_path(user_module):
    fn = load_reward_fn("userrewards.fns:contains_answer")
    assert fn(["p"], ["it is 7"], [7]) == [1.0]
    assert load_reward_fn("userrewards.fns.contains_answer") is fn
    assert load_reward_fn("userrewards.fns:Holder.half")(["p", "q"], ["a", "b"], [1, 2]) == [0.5, 0.5]
    assert build_reward_fn("userrewards.fns:make_const", {"value": 2.0})(["p"], ["a"], [0]) == [2.0]


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("userrewards.nosuch:fn", "module 'userrewards.nosuch' not found"),
        ("nosuchpkg_xyz.mod.fn", "no importable module"),
        ("userrewards.fns:missing", "has no attribute 'missing'"),
        ("userrewards.fns.missing", "has no attribute 'missing'"),
        ("userrewards.fns:NOT_CALLABLE", "not callable"),
        ("userrewards.broken:fn", "definitely_missing_dependency_xyz"),  # the module's own import fails
        ("a:b:c", "package.module:function"),
    ],
)
def test_load_reward_fn_errors(user_module, path, message):
    with pytest.raises(ConfigError, match=message):
        load_reward_fn(path)


def test_score_and_combine(user_module):
    scores = score_completions(
        {"math": build_reward_fn("math"), "fmt": build_reward_fn("format")},
        ["p1", "p2"],
        [r"\boxed{4}", "4"],
        ["4", "4"],
    )
    assert scores == {"math": [1.0, 1.0], "fmt": [1.0, 0.0]}
    assert combine_rewards(scores, {"math": 1.0, "fmt": 0.5}) == [1.5, 1.0]
    with pytest.raises(ConfigError, match="no weight"):
        combine_rewards(scores, {"math": 1.0})
    with pytest.raises(ConfigError, match="no such fn"):
        combine_rewards(scores, {"math": 1.0, "fmt": 1.0, "typo": 1.0})
    with pytest.raises(ConfigError, match="returned 1 scores for 2 completions"):
        score_completions({"bad": load_reward_fn("userrewards.fns:wrong_count")}, ["a", "b"], ["a", "b"], [1, 2])


def test_a_reward_that_raises_or_returns_nan_is_named_with_the_completion_and_its_prompt(user_module):
    """One line naming the reward fn, the completion's index in the batch and its prompt's; the fn's own exception
    is the cause (its traceback kept for the job's log)."""
    prompts = ["What is 1+1?"] * 2 + ["What is 2+2?"] * 2  # prompt-major, two completions each
    with pytest.raises(ConfigError) as raised:
        score_completions({"mine": load_reward_fn("userrewards.fns:divides")}, prompts, ["a", "b", "c", ""], [0] * 4)
    assert str(raised.value) == ("reward 'mine' raised ZeroDivisionError: float division by zero on completion 3 "
                                 "(prompt 1 of the batch: 'What is 2+2?'); fix the reward function (or drop it "
                                 "from algorithm.rewards)")
    assert isinstance(raised.value.__cause__, ZeroDivisionError)
    with pytest.raises(ConfigError) as raised:
        score_completions({"nan": load_reward_fn("userrewards.fns:nan_on_b")}, prompts, ["a", "b", "c", "d"], [0] * 4)
    assert str(raised.value) == ("reward 'nan' returned nan (not finite) for completion 1 (prompt 0 of the batch: "
                                 "'What is 1+1?'); a reward fn must return finite scores")


def test_weighted_rewards_from_specs(user_module):
    rewards = WeightedRewards.from_specs(
        {
            "math": {"weight": 1.0},
            "contains": {"fn": "userrewards.fns:contains_answer", "weight": 0.25},
        }
    )
    total, per_fn = rewards.score(["p"], ["it is 7, no wait 8"], ["7"])
    assert per_fn == {"math": [0.0], "contains": [1.0]}
    assert total == [0.25]
    with pytest.raises(ConfigError, match="unknown keys"):
        WeightedRewards.from_specs({"math": {"wieght": 1.0}})


def test_config_reward_entries_take_options(tmp_path):
    """A weight, or {weight, options}: from YAML and from key=value overrides, checked before the job starts."""
    path = tmp_path / "job.yaml"
    path.write_text("algorithm:\n  rewards:\n    format: {weight: 0.5, pattern: '<a>.*</a>'}\n    exact: 1.0\n")
    algo = load_config(path, ["algorithm.rewards.math_verify.weight=2", "algorithm.rewards.math_verify.tolerance=1e-6",
                              "algorithm.rewards.exact=0.25"]).algorithm
    assert algo.reward_weights == {"format": 0.5, "exact": 0.25, "math_verify": 2.0}
    assert algo.reward_options == {"format": {"pattern": "<a>.*</a>"}, "exact": {}, "math_verify": {"tolerance": 1e-6}}
    assert load_config(None, ["algorithm.rewards.math.tolerance=0.01"]).algorithm.reward_weights == {"math": 1.0}
    assert load_config(None, []).algorithm.reward_options == {"exact": {}}
    fns = {name: build_reward_fn(name, options) for name, options in algo.reward_options.items()}
    assert fns["format"](["p"], ["<a>1</a>"], [None]) == [1.0] and fns["math_verify"].tolerance == 1e-6


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algorithm.rewards.format.patern=x", "algorithm.rewards.format: unknown option patern (did you mean "
                                               "'pattern'?); valid options: pattern, required_tags"),
        ("algorithm.rewards.exact.weight=high", "algorithm.rewards.exact: weight 'high' is not a number"),
        ("algorithm.rewards.math=true", "algorithm.rewards.math: weight True is not a number"),
        ("algorithm.rewards.rm.checkpoint=x", "algorithm.rewards.rm takes only a weight"),
    ],
)
def test_config_reward_entry_errors(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


def test_bad_reward_option_exits_2_before_the_job(launch, tmp_path):
    result = launch(f"run.dir={tmp_path / 'run'}", "algorithm.rewards.math_verify.tolerence=0.1", "--dry-run")
    assert result.returncode == 2
    assert "algorithm.rewards.math_verify: unknown option tolerence (did you mean 'tolerance'?); valid options: " \
           "tolerance, backend" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_reward_that_raises_in_a_job_ends_it_with_one_line_and_exit_2(launch, tmp_path, user_module):
    """The job's ranks: one line naming the reward, the completion and its prompt, exit 2, no traceback on the
    console; the traceback is in the rank's error log, which the line names."""
    run_dir = tmp_path / "run"
    result = launch(f"run.dir={run_dir}", "cluster.tasks_per_node=1", "algorithm.sft_warmup_steps=0", "run.steps=1",
                    "algorithm.rewards={'userrewards.fns:unreachable': 1.0}", env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    kept = run_dir / "logs" / "error_rank0.log"
    line = ("error: reward 'userrewards.fns:unreachable' raised ConnectionError: the judge is unreachable on "
            "completion 0 (prompt 0 of the batch: ")
    errors = [text.strip() for text in result.stderr.splitlines() if text.strip().startswith("error:")]  # the tail
    assert len(errors) == 1 and errors[0].startswith(line) and errors[0].endswith(f"(its traceback: {kept})"), errors
    assert "Traceback" not in result.stdout + result.stderr
    assert 'raise ConnectionError("the judge is unreachable")' in kept.read_text()
