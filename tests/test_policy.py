"""The launch policy's rules, spellings, clamps and edges (docs/launch-policy.md), one behaviour per test."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metrale_attn import policy
from metrale_attn.policy import (
    DECODE_GQA_PACK_DECLARED,
    DECODE_GQA_PACK_HEAD_DIM,
    DECODE_GQA_PACK_WIDTH,
    MAX_DECODE_SPLITS,
    PD_MIN_KV_PER_SPLIT,
    SPLITK_TARGET_WAVES,
    SplitkPolicy,
    auto_splits,
    gqa_pack_ctas,
    gqa_pack_enabled,
    gqa_pack_shape_ok,
    legacy_splits,
    num_splits,
    parse,
    parse_gqa_pack,
    policy_from_env,
    resolve_gqa_pack,
    resolve_policy,
    split_ref_seqs,
    workspace_slots,
)

U32 = st.integers(0, 2**32 - 1)
SMALL = st.integers(0, 4096)
POLICIES = st.one_of(
    st.just(SplitkPolicy.LEGACY),
    st.just(SplitkPolicy.AUTO),
    st.integers(1, MAX_DECODE_SPLITS).map(SplitkPolicy.pinned),
)
NON_LEGACY = st.one_of(st.just(SplitkPolicy.AUTO), st.integers(1, MAX_DECODE_SPLITS).map(SplitkPolicy.pinned))


def test_the_constants_are_the_seeds():
    assert SPLITK_TARGET_WAVES == 2
    assert MAX_DECODE_SPLITS == 16
    assert DECODE_GQA_PACK_WIDTH == 6
    assert DECODE_GQA_PACK_HEAD_DIM == 256
    assert DECODE_GQA_PACK_DECLARED is False
    assert PD_MIN_KV_PER_SPLIT == 256


# -- parse ------------------------------------------------------------------


@pytest.mark.parametrize(
    "spelling, expected",
    [
        ("legacy", SplitkPolicy.LEGACY),
        ("auto", SplitkPolicy.AUTO),
        ("  AUTO\t", SplitkPolicy.AUTO),
        ("Legacy\n", SplitkPolicy.LEGACY),
        ("0", SplitkPolicy.pinned(1)),
        ("off", SplitkPolicy.pinned(1)),
        ("OFF", SplitkPolicy.pinned(1)),
        ("false", SplitkPolicy.pinned(1)),
        ("No", SplitkPolicy.pinned(1)),
        ("1", SplitkPolicy.pinned(1)),
        ("4", SplitkPolicy.pinned(4)),
        (" 4 ", SplitkPolicy.pinned(4)),
        ("+4", SplitkPolicy.pinned(4)),
        ("00", SplitkPolicy.pinned(1)),
        ("007", SplitkPolicy.pinned(7)),
        ("16", SplitkPolicy.pinned(16)),
        ("17", SplitkPolicy.pinned(16)),
        ("4294967295", SplitkPolicy.pinned(16)),
        ("\u30004\u2003", SplitkPolicy.pinned(4)),
    ],
)
def test_parse_reads_every_spelling_of_the_seed(spelling, expected):
    assert parse(spelling) == expected


@pytest.mark.parametrize(
    "spelling",
    ["", " ", "-1", "-0", "4.0", "1e2", "1_0", "0x10", "4294967296", "99999999999999999999", "++4", "4 4",
     "autos", "on", "true", "yes", "\u0663", "\x1c4", "4\x1f", "ａｕｔｏ", "ＬＥＧＡＣＹ"],
)
def test_parse_refuses_what_an_unsigned_32_bit_parse_refuses(spelling):
    assert parse(spelling) is None


def test_a_pinned_count_is_clamped_to_one_through_sixteen():
    assert SplitkPolicy.pinned(0).count == 1
    assert SplitkPolicy.pinned(40).count == MAX_DECODE_SPLITS
    with pytest.raises(ValueError, match="pinned split count"):
        SplitkPolicy("pinned", 17)
    with pytest.raises(ValueError, match="count"):
        SplitkPolicy.pinned(-1)


@given(POLICIES)
def test_parse_of_a_label_round_trips(p):
    assert parse(p.label()) == p


def test_labels_are_the_spellings_printed_in_the_target_line():
    assert SplitkPolicy.LEGACY.label() == "legacy"
    assert SplitkPolicy.AUTO.label() == "auto"
    assert SplitkPolicy.pinned(4).label() == "4"


# -- resolution -------------------------------------------------------------


def test_a_parseable_environment_value_overrides_the_declaration():
    assert resolve_policy("auto", "4") == (SplitkPolicy.pinned(4), True)
    assert resolve_policy("auto", "legacy") == (SplitkPolicy.LEGACY, True)
    assert resolve_policy("legacy", "off") == (SplitkPolicy.pinned(1), True)


def test_an_unparseable_environment_value_keeps_the_declaration():
    assert resolve_policy("auto", "sixteen") == (SplitkPolicy.AUTO, False)
    assert resolve_policy("auto", "") == (SplitkPolicy.AUTO, False)
    assert resolve_policy("auto", None) == (SplitkPolicy.AUTO, False)


def test_an_unparseable_or_missing_declaration_is_legacy():
    assert resolve_policy("", None) == (SplitkPolicy.LEGACY, False)
    assert resolve_policy("whatever", "nonsense") == (SplitkPolicy.LEGACY, False)


def test_policy_from_env_reads_the_environment_over_the_declaration(monkeypatch):
    monkeypatch.setenv("METRALE_ATTN_DECODE_SPLITK", " 3 ")
    assert policy_from_env("auto") == SplitkPolicy.pinned(3)
    monkeypatch.setenv("METRALE_ATTN_DECODE_SPLITK", "garbage")
    assert policy_from_env("auto") == SplitkPolicy.AUTO
    monkeypatch.delenv("METRALE_ATTN_DECODE_SPLITK")
    assert policy_from_env("auto") == SplitkPolicy.AUTO
    assert policy_from_env("auto", {"METRALE_ATTN_DECODE_SPLITK": "legacy"}) == SplitkPolicy.LEGACY


# -- split counts -----------------------------------------------------------


@pytest.mark.parametrize(
    "sms, heads, expected",
    [(148, 24, 13), (132, 24, 11), (132, 32, 9), (132, 64, 5), (132, 1, 16), (48, 24, 4), (132, 264, 1),
     (132, 1000, 1), (0, 24, 1), (132, 0, 16), (0, 0, 2)],
)
def test_auto_fills_two_waves_clamped_to_one_through_sixteen(sms, heads, expected):
    assert auto_splits(sms, heads) == expected


def test_auto_saturates_instead_of_wrapping_on_a_huge_sm_count():
    assert auto_splits(2**32 - 1, 2**32 - 1) == 1
    assert auto_splits(2**32 - 1, 1) == MAX_DECODE_SPLITS


@given(U32, U32)
def test_auto_is_always_within_one_and_sixteen(sms, heads):
    assert 1 <= auto_splits(sms, heads) <= MAX_DECODE_SPLITS


@given(st.integers(1, 10_000), st.integers(1, 10_000))
def test_auto_puts_two_waves_on_the_device_with_one_sequence_when_the_cap_allows(sms, heads):
    splits = auto_splits(sms, heads)
    if splits < MAX_DECODE_SPLITS:
        assert heads * splits >= SPLITK_TARGET_WAVES * sms or splits == 1


@pytest.mark.parametrize(
    "sms, heads, ref, expected",
    [(132, 24, 1, 5), (132, 24, 2, 2), (132, 24, 5, 1), (132, 24, 6, 1), (132, 1, 1, 132), (132, 0, 0, 132),
     (0, 24, 1, 1), (148, 24, 1, 6), (48, 24, 1, 2), (48, 24, 2, 1)],
)
def test_legacy_divides_the_sms_by_the_ctas_of_the_reference_batch(sms, heads, ref, expected):
    assert legacy_splits(sms, heads, ref) == expected


def test_legacy_saturates_the_cta_product():
    assert legacy_splits(132, 2**32 - 1, 2**32 - 1) == 1


def test_split_ref_seqs_is_the_larger_of_the_batch_and_the_configured_reference():
    assert split_ref_seqs(3, 8) == 8
    assert split_ref_seqs(9, 8) == 9
    assert split_ref_seqs(0, 0) == 0


def test_the_auto_split_count_does_not_move_with_the_co_batched_count():
    counts = {num_splits(SplitkPolicy.AUTO, 148, 24, split_ref_seqs(n, 1)) for n in range(1, 513)}
    assert counts == {13}


@given(NON_LEGACY, SMALL, SMALL, U32, U32)
def test_auto_and_pinned_never_read_the_reference_batch(p, sms, heads, ref_a, ref_b):
    assert num_splits(p, sms, heads, ref_a) == num_splits(p, sms, heads, ref_b)


def test_legacy_moves_with_the_co_batched_count():
    counts = [num_splits(SplitkPolicy.LEGACY, 132, 24, split_ref_seqs(n, 1)) for n in (1, 2, 6)]
    assert counts == [5, 2, 1]


def test_a_pinned_policy_splits_exactly_its_count():
    assert num_splits(SplitkPolicy.pinned(7), 132, 24, 1) == 7


# -- workspace --------------------------------------------------------------


def test_legacy_workspace_is_one_slot_per_sm():
    assert workspace_slots(SplitkPolicy.LEGACY, 132, 24, 256, 1) == 132
    assert workspace_slots(SplitkPolicy.LEGACY, 0, 24, 256, 1) == 1


def test_auto_and_pinned_workspace_is_rows_times_heads_times_splits():
    assert workspace_slots(SplitkPolicy.AUTO, 132, 24, 256, 1) == 256 * 24 * 11
    assert workspace_slots(SplitkPolicy.pinned(4), 132, 24, 0, 1) == 1 * 24 * 4
    assert workspace_slots(SplitkPolicy.AUTO, 132, 0, 0, 1) == 16


def test_workspace_saturates_instead_of_wrapping():
    assert workspace_slots(SplitkPolicy.pinned(16), 132, 2**32 - 1, 2**32 - 1, 1) == 2**32 - 1


@given(st.integers(1, 4096), st.integers(1, 512), st.integers(1, 1024), st.integers(0, 1024))
def test_the_legacy_workspace_covers_every_legacy_launch_that_splits(sms, heads, num_seqs, max_decode):
    ref = split_ref_seqs(num_seqs, max_decode)
    splits = num_splits(SplitkPolicy.LEGACY, sms, heads, ref)
    if splits > 1:
        assert num_seqs * heads * splits <= sms == workspace_slots(SplitkPolicy.LEGACY, sms, heads, num_seqs, ref)


@given(NON_LEGACY, st.integers(1, 4096), st.integers(1, 512), st.integers(1, 1024), st.integers(0, 1024))
def test_the_workspace_for_max_rows_covers_every_batch_up_to_it(p, sms, heads, max_rows, num_seqs):
    num_seqs = min(num_seqs, max_rows)
    splits = num_splits(p, sms, heads, num_seqs)
    assert num_seqs * heads * splits <= workspace_slots(p, sms, heads, max_rows, 1)


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "4", True])
def test_counts_outside_unsigned_32_bits_are_refused_with_the_argument_named(bad):
    with pytest.raises((ValueError, TypeError), match="sm_count"):
        auto_splits(bad, 24)


# -- GQA pack gate ----------------------------------------------------------


@pytest.mark.parametrize("spelling", ["1", "on", "TRUE", " yes "])
def test_gqa_pack_on_spellings(spelling):
    assert parse_gqa_pack(spelling) is True


@pytest.mark.parametrize("spelling", ["0", "off", "False", "NO\n"])
def test_gqa_pack_off_spellings(spelling):
    assert parse_gqa_pack(spelling) is False


@pytest.mark.parametrize("spelling", ["", "2", "enable", "y", "\u0661"])
def test_gqa_pack_refuses_other_spellings(spelling):
    assert parse_gqa_pack(spelling) is None


def test_a_parseable_gqa_pack_value_overrides_the_declaration_and_garbage_keeps_it():
    assert resolve_gqa_pack(False, "on") is True
    assert resolve_gqa_pack(True, "off") is False
    assert resolve_gqa_pack(True, "maybe") is True
    assert resolve_gqa_pack(False, None) is False


def test_gqa_pack_enabled_is_resolved_once_per_process_until_the_cache_is_cleared(monkeypatch):
    gqa_pack_enabled.cache_clear()
    monkeypatch.setenv("METRALE_ATTN_DECODE_GQA_PACK", "on")
    try:
        assert gqa_pack_enabled() is True
        monkeypatch.setenv("METRALE_ATTN_DECODE_GQA_PACK", "off")
        assert gqa_pack_enabled() is True
        gqa_pack_enabled.cache_clear()
        assert gqa_pack_enabled() is False
    finally:
        gqa_pack_enabled.cache_clear()


@pytest.mark.parametrize(
    "q, kv, d, ok",
    [(24, 4, 256, True), (48, 8, 256, True), (6, 1, 256, True), (25, 4, 256, False), (23, 4, 256, False),
     (24, 4, 128, False), (24, 0, 256, False), (0, 0, 256, False), (32, 8, 256, False), (24, 24, 256, False)],
)
def test_the_gqa_pack_shape_gate_multiplies_rather_than_divides(q, kv, d, ok):
    assert gqa_pack_shape_ok(q, kv, d) is ok


def test_packed_ctas_are_kv_heads_times_seqs():
    assert gqa_pack_ctas(4, 12) == 48
    assert gqa_pack_ctas(2**32 - 1, 2) == 2**32 - 1


def test_policy_imports_nothing_of_the_package_nor_cupy_nor_numpy():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(policy))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "." for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    relative = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level]
    assert not relative
    assert not imported & {"cupy", "numpy", "metrale_attn"}
