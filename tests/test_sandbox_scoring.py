"""Position score on the real Kaggle leaderboards, the reward ladder, avg@k — worked by hand."""

import pathlib
import random

import numpy as np
import pytest

import sandbox
from sandbox.scoring import board_position, board_positions
from sandbox.tasks import read_leaderboard

FIX = pathlib.Path(__file__).parent / "fixtures" / "mle-dojo"


def _board(comp, which):
    return read_leaderboard(FIX / comp / "info" / f"{which}_leaderboard.csv")


def _mle_dojo_position(score, scores, higher_is_better):
    """MLE-Dojo's `_calculate_leaderboard_position` loop, written out independently."""
    total = len(scores)
    ordered = sorted(scores, reverse=higher_is_better)
    position = total + 1
    for i, s in enumerate(ordered):
        if (score >= s) if higher_is_better else (score <= s):
            position = i + 1
            break
    return position, total


def test_real_boards_have_the_sizes_and_heads_we_worked_with():
    st = _board("spaceship-titanic", "private")
    assert st.shape == (1967,) and list(st[:4]) == [1.0, 0.96305, 0.82183, 0.8209]
    assert _board("spaceship-titanic", "public").shape == (1965,)
    crab = _board("playground-series-s3e16", "private")
    assert crab.shape == (1429,) and list(crab[:2]) == [1.33429, 1.3351] and crab[-1] == 9999.66952


def test_position_higher_is_better_by_hand():
    priv, pub = _board("spaceship-titanic", "private"), _board("spaceship-titanic", "public")
    # 0.9 is beaten only by 1.0 and 0.96305 -> 3rd place on both boards.
    assert board_position(0.9, priv, True) == (3, 1967)
    assert board_position(0.9, pub, True) == (3, 1965)
    expected = ((1967 - 3 + 1) / 1967 + (1965 - 3 + 1) / 1965) / 2
    assert sandbox.position_score(0.9, {"private": priv, "public": pub}, True) == pytest.approx(expected, abs=1e-15)
    # A tie takes the best rank of the tied group: 0.82066 ties ranks 5-7 -> position 5.
    assert board_position(0.82066, priv, True) == (5, 1967)
    # Winning outright and losing to everyone (the board ends with zeros).
    assert sandbox.position_score(1.0, [priv], True) == 1.0
    assert board_position(-0.1, priv, True) == (1968, 1967)
    assert sandbox.position_score(-0.1, [priv, pub], True) == 0.0


def test_position_lower_is_better_by_hand():
    priv, pub = _board("playground-series-s3e16", "private"), _board("playground-series-s3e16", "public")
    # MAE 1.3351 is beaten only by 1.33429 on the private board -> 2nd.
    assert board_position(1.3351, priv, False) == (2, 1429)
    assert board_positions(1.3351, {"private": priv}, False)["private"]["position_score"] == 1428 / 1429
    # Better than every public entry (1.32867 is rank 1) -> 1st.
    assert board_position(1.0, pub, False) == (1, 1429)
    # Tying the last entry is last place, worse than it is past the end.
    assert board_position(9999.66952, priv, False) == (1429, 1429)
    assert sandbox.position_score(1e5, {"private": priv, "public": pub}, False) == 0.0


@pytest.mark.parametrize("comp,higher", [("spaceship-titanic", True), ("playground-series-s3e12", True),
                                         ("playground-series-s3e16", False)])
def test_position_matches_mle_dojo_loop_on_real_boards(comp, higher):
    boards = {b: _board(comp, b) for b in ("private", "public")}
    rng = random.Random(0)
    pool = np.concatenate(list(boards.values()))
    scores = [float(rng.choice(pool)) for _ in range(60)]                       # exact ties
    scores += [rng.uniform(float(pool.min()) - 1, float(np.quantile(pool, 0.99))) for _ in range(60)]
    for s in scores:
        per = []
        for b in boards.values():
            pos, total = _mle_dojo_position(s, list(b), higher)
            assert board_position(s, b, higher) == (pos, total)
            per.append((total - pos + 1) / total)
        assert sandbox.position_score(s, boards, higher) == pytest.approx(sum(per) / len(per), abs=1e-15)


def test_position_errors_name_the_input():
    with pytest.raises(ValueError, match="board"):
        board_position(0.5, [], True)
    with pytest.raises(ValueError, match="score"):
        board_position(float("nan"), [1.0], True)
    with pytest.raises(ValueError, match="boards"):
        sandbox.position_score(0.5, {}, True)


def test_reward_ladder_constants_and_function():
    assert sandbox.REWARD_LADDER == {"malformed": 0.0, "syntax_err": 0.0, "runtime_err": 0.1,
                                     "ran_no_sub": 0.2, "valid": 0.5, "unknown": None}
    assert sandbox.ladder_reward("valid", 0.0) == 0.5
    assert sandbox.ladder_reward("valid", 0.6) == pytest.approx(0.8)
    assert sandbox.ladder_reward("valid", 1.0) == 1.0
    assert sandbox.ladder_reward("unknown") is None
    with pytest.raises(ValueError, match="position"):
        sandbox.ladder_reward("valid", None)
    with pytest.raises(ValueError, match="status"):
        sandbox.ladder_reward("crashed")


def _res(status, pos=None):
    return sandbox.ExecutionResult(task_id="t", code_sha256="0" * 64, status=status,
                                   reward=sandbox.ladder_reward(status, pos), position_score=pos)


def test_avg_at_k_hand_worked():
    results = {
        # 2 of 4 attempts valid, best positions 0.8 and 0.4 -> 0.5 * 0.6 = 0.3
        "A": [0.8, None, 0.4, None],
        # attempt 1: two turns, the valid one scores 0.9; attempt 2 crashed -> 0.5 * 0.9 = 0.45
        "B": [[_res("ran_no_sub"), _res("valid", 0.9)], _res("runtime_err")],
        # nothing valid -> 0
        "C": [None, _res("syntax_err")],
    }
    out = sandbox.avg_at_k(results, categories={"A": "cls", "B": "cls", "C": "reg"})
    assert out.per_task == pytest.approx({"A": 0.3, "B": 0.45, "C": 0.0})
    assert out.valid_rate == pytest.approx({"A": 0.5, "B": 0.5, "C": 0.0})
    assert out.score == pytest.approx(0.25)
    assert out.per_category == pytest.approx({"cls": 0.375, "reg": 0.0})
    assert out.k == {"A": 4, "B": 2, "C": 2}


def test_avg_at_k_best_turn_and_k_check():
    # The best valid turn of an attempt counts, not the last one.
    out = sandbox.avg_at_k({"T": [[_res("valid", 0.7), _res("valid", 0.2)]] * 8}, k=8)
    assert out.score == pytest.approx(0.7)
    with pytest.raises(ValueError, match="k=8"):
        sandbox.avg_at_k({"T": [0.5] * 7}, k=8)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        sandbox.avg_at_k({"T": [1.5]})
