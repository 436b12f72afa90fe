"""The action tokenizer against OpenVLA's formulas (np.digitize on linspace edges) and numbers worked by hand."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from wmrl_jax.vla import ActionTokenizer


def test_hand_computed_example():
    """V = 32000 (OpenVLA's Llama), 256 edges 2/255 apart: 0 sits in the middle of bin 127 (edges ±1/255)."""
    tok = ActionTokenizer(vocab_size=32000)
    assert tok.first_id == 31744 and tok.centres.shape == (255,) and tok.half_bin == pytest.approx(1 / 255)
    a = np.asarray([[0.0, 1.0, -1.0, -0.999, 0.5, 7.0, -3.0]])
    # 0 -> digitize 128 -> id 31872 -> centre (e127 + e128) / 2 = 0; +1 -> digitize 256 -> id 31744 -> last centre
    # 1 - 1/255; -1 and -0.999 -> digitize 1 -> id 31999 -> first centre -1 + 1/255; 0.5: edges i = (0.5 + 1) · 127.5 =
    # 191.25 -> digitize 192 -> id 31808 -> centre -1 + (191 + 0.5) · 2/255; out of range values are clipped.
    want_ids = [[31872, 31744, 31999, 31999, 31808, 31744, 31999]]
    np.testing.assert_array_equal(tok.encode(a), want_ids)
    c = 1 - 1 / 255
    want = [[0.0, c, -c, -c, -1 + 191.5 * 2 / 255, c, -c]]
    np.testing.assert_allclose(tok.decode(np.asarray(want_ids)), want, atol=1e-6)


def test_round_trip_within_half_a_bin_and_openvla_formula():
    tok = ActionTokenizer(vocab_size=1000, n_bins=256)
    rng = np.random.default_rng(0)
    a = rng.uniform(-1.3, 1.3, size=(64, 5, 7))
    ids = tok.encode(a)
    assert ids.dtype == np.int32 and ids.min() >= tok.first_id and ids.max() < 1000
    # OpenVLA: vocab_size - np.digitize(clip(a), linspace(-1, 1, 256)).
    np.testing.assert_array_equal(ids, 1000 - np.digitize(np.clip(a, -1, 1), np.linspace(-1, 1, 256)))
    back = tok.decode(ids)
    assert back.dtype == np.float32 and np.abs(back).max() < 1
    assert np.abs(back - np.clip(a, -1, 1)).max() <= tok.half_bin + 1e-6
    # Bin centres are fixed points, except that the first id (an action of exactly +1, here every clipped one)
    # decodes to the last centre, which is the next id's. jax in, jax out, the same ids (also under jit).
    assert (ids == tok.first_id).any()
    np.testing.assert_array_equal(tok.encode(back), np.where(ids == tok.first_id, tok.first_id + 1, ids))
    np.testing.assert_array_equal(np.asarray(jax.jit(tok.encode)(jnp.asarray(a, jnp.float32))), ids)
    np.testing.assert_allclose(np.asarray(jax.jit(tok.decode)(jnp.asarray(ids))), back, atol=1e-7)
    np.testing.assert_array_equal(tok.bins_to_ids(tok.ids_to_bins(ids)), ids)


def test_bad_input_names_what_is_wrong():
    tok = ActionTokenizer(vocab_size=300)
    with pytest.raises(ValueError, match=r"actions: shape \(2, 6\), expected \[\.\.\., 7\] \(action_dim=7\)"):
        tok.encode(np.zeros((2, 6)))
    with pytest.raises(ValueError, match=r"ids: 10 \(and 0 more\) outside the action ids \[44, 300\)"):
        tok.decode(np.asarray([[10, 44, 45, 46, 47, 48, 299]]))
    with pytest.raises(ValueError, match="expected floating point"):
        tok.encode(np.zeros((1, 7), np.int64))
    with pytest.raises(ValueError, match="n_bins=256 does not fit in vocab_size=100"):
        ActionTokenizer(vocab_size=100)
    assert repr(tok) == "ActionTokenizer(vocab_size=300, n_bins=256, action_dim=7, low=-1.0, high=1.0)"
