"""The pure logic of the quality measurement, against hand-computed figures: the KL of two top-k
lists with a rest bucket, the parser of llama-perplexity's KL output, its context choice, the
evaluation windows and the evaluation-set file."""

from __future__ import annotations

import math

import pytest

from objectives.userfile import InputError
from runners.quality import QualityUnavailable, eval_set_hash, load_eval_prompts
from runners.quality.llamacpp import context_for, parse_kl_output
from runners.quality.logprob import bucket_kl, compare, token_windows

ln = math.log


def test_kl_of_full_lists_is_the_exact_kl():
    # p = (.5, .3, .2), q = (.4, .4, .2): .5 ln(.5/.4) + .3 ln(.3/.4) + 0 = 0.111572 - 0.086305
    p = {1: ln(0.5), 2: ln(0.3), 3: ln(0.2)}
    q = {1: ln(0.4), 2: ln(0.4), 3: ln(0.2)}
    assert bucket_kl(p, q) == pytest.approx(0.025267, abs=1e-6)


def test_kl_puts_tokens_one_side_does_not_list_in_the_rest_bucket():
    # Shared: token 1 only. Reference rest 1 - .5 = .5, candidate rest 1 - .4 = .6:
    # .5 ln(.5/.4) + .5 ln(.5/.6) = 0.111572 - 0.091161
    p = {1: ln(0.5), 2: ln(0.3)}
    q = {1: ln(0.4), 3: ln(0.2)}
    assert bucket_kl(p, q) == pytest.approx(0.020411, abs=1e-6)


def test_kl_of_identical_lists_is_zero_and_never_negative():
    p = {7: ln(0.25), 9: ln(0.125)}
    assert bucket_kl(p, dict(p)) == 0.0


def test_kl_when_the_candidate_lists_all_its_mass_elsewhere_is_large_but_finite():
    # Reference keeps .5 outside token 1; the candidate puts all its mass on token 1 (rest 0).
    p = {1: ln(0.5)}
    q = {1: 0.0}
    value = bucket_kl(p, q)
    assert math.isfinite(value) and value > 10  # .5 ln(.5/1) + .5 ln(.5/1e-12) = 13.47
    assert value == pytest.approx(0.5 * ln(0.5) + 0.5 * ln(0.5 / 1e-12), rel=1e-9)


def test_compare_averages_over_every_position_and_counts_top_token_matches():
    ref = [[{1: ln(0.6), 2: ln(0.4)}, {3: ln(0.9), 4: ln(0.1)}]]
    same = [[{1: ln(0.6), 2: ln(0.4)}, {3: ln(0.2), 4: ln(0.8)}]]
    kl, agreement, positions = compare(ref, same)
    # position 1 identical (0); position 2: .9 ln(.9/.2) + .1 ln(.1/.8) = 1.353670 - 0.207944
    assert kl == pytest.approx((0 + 1.145726) / 2, abs=1e-6)
    assert agreement == 0.5 and positions == 2


def test_a_tie_for_the_top_token_is_agreement_whichever_way_it_is_listed():
    tied = {4: ln(0.4), 5: ln(0.4), 6: ln(0.2)}
    listed_otherwise = {5: ln(0.4), 4: ln(0.4), 6: ln(0.2)}
    assert compare([[tied]], [[listed_otherwise]]) == (0.0, 1.0, 1)
    assert (
        compare([[tied]], [[{4: ln(0.3), 5: ln(0.5), 6: ln(0.2)}]])[1] == 1.0
    )  # 5 is a top token of both
    assert compare([[tied]], [[{4: ln(0.2), 5: ln(0.2), 6: ln(0.6)}]])[1] == 0.0


class _Tokenizer:
    """A fake tokenizer: one token per character, code point as id, a BOS of 0 in front."""

    def __call__(self, text):
        return {"input_ids": [0, *map(ord, text)]}


def test_windows_cut_long_prompts_and_drop_one_token_pieces():
    windows = token_windows(_Tokenizer(), ["a" * 9, ""], window=4)
    # "a"*9 -> 10 tokens -> 4 + 4 + 2; "" -> [BOS] alone, nothing to score
    assert [len(w) for w in windows] == [4, 4, 2]
    assert windows[0][0] == 0 and windows[1] == [97] * 4


# llama-perplexity's output verbatim: its chunk table runs past the line length.
KL_OUTPUT = """\
kl_divergence: computing over 17 chunks, n_ctx=128, batch_size=2048, n_seq=16
chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p
   1    1997.1187 ±  101.0366       0.00098 ±    0.00080       0.00072 ±    0.00003     0.021 ±  0.001 %    97.619 ±  1.363 %

====== KL divergence statistics ======
Mean    KLD:   0.000712 ±   0.000031
Maximum KLD:   0.004211

====== Token probability statistics ======
Same top p: 96.172 ±  0.588 %
"""  # noqa: E501


def test_parser_reads_llama_perplexitys_mean_kld_same_top_and_positions():
    result = parse_kl_output(KL_OUTPUT)
    assert result.mean_kld == pytest.approx(0.000712)
    assert result.same_top == pytest.approx(0.96172)
    assert result.positions == 17 * 63  # each chunk of 128 scores positions 64..126


# The same run's table with its summary lost at exit (the log thread's last lines, seen in CI):
# the last chunk's row holds the running figures over all 17 chunks.
KL_OUTPUT_NO_SUMMARY = """\
kl_divergence: computing over 17 chunks, n_ctx=128, batch_size=2048, n_seq=16
chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p
   1    1997.1187 ±  101.0366       0.00098 ±    0.00080       0.00072 ±    0.00003     0.021 ±  0.001 %    97.619 ±  1.363 %
  17    1890.5521 ±   24.1187       0.00011 ±    0.00019       0.00071 ±    0.00003     0.020 ±  0.001 %    96.172 ±  0.588 %

"""  # noqa: E501


def test_parser_reads_the_last_chunks_row_when_the_summary_was_lost():
    result = parse_kl_output(KL_OUTPUT_NO_SUMMARY)
    assert result.mean_kld == pytest.approx(0.00071)
    assert result.same_top == pytest.approx(0.96172)
    assert result.positions == 17 * 63


def test_parser_refuses_a_table_cut_before_its_last_chunk():
    cut = KL_OUTPUT_NO_SUMMARY.split("  17 ")[0]  # chunk 1 of 17: not the whole text's figure
    with pytest.raises(QualityUnavailable, match="printed no KL divergence"):
        parse_kl_output(cut)


def test_parser_refuses_a_nan_divergence_as_no_figure():
    """A model whose logits overflowed: printf writes nan, which is no KL a constraint can use."""
    broken = KL_OUTPUT.replace("0.000712 ±   0.000031", "nan ±   nan")
    with pytest.raises(QualityUnavailable, match=r"not finite \(mean KLD nan, same top token 96"):
        parse_kl_output(broken)
    row_only = KL_OUTPUT_NO_SUMMARY.replace("0.00071 ±    0.00003", "-nan ±    nan")
    with pytest.raises(QualityUnavailable, match="not finite"):
        parse_kl_output(row_only)


def test_parser_says_why_when_the_tool_printed_no_figures():
    with pytest.raises(QualityUnavailable, match=r"failed to open /x/base\.kld"):
        parse_kl_output("main: build = 1\nkl_divergence: failed to open /x/base.kld\n")


def test_perplexity_context_fits_two_chunks_into_the_text():
    assert context_for(2235) == 128  # capped
    assert context_for(100) == 48  # (100 - 4) / 2
    with pytest.raises(QualityUnavailable, match="evaluation set is 30 tokens"):
        context_for(30)


def test_shipped_evaluation_set_is_varied_and_its_hash_stable():
    prompts = load_eval_prompts(None)
    assert 24 <= len(prompts) <= 60
    assert any("def " in p for p in prompts) and any("用户" in p for p in prompts)
    assert eval_set_hash(prompts) == eval_set_hash(list(prompts))
    assert eval_set_hash(prompts) != eval_set_hash(prompts[1:])


def test_a_users_prompts_file_is_read_and_checked(tmp_path):
    good = tmp_path / "prompts.yaml"
    good.write_text(
        "prompts:\n  - 'Patient reports chest pain.'\n  - 'Dosage: 5 mg daily.'\n", encoding="utf-8"
    )
    assert load_eval_prompts(good) == ["Patient reports chest pain.", "Dosage: 5 mg daily."]
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("prompts:\n  - 'café'\n".encode("latin-1"))
    with pytest.raises(
        InputError, match=r"latin1\.yaml: not UTF-8 text \(byte \d+\); save it as UTF-8"
    ):
        load_eval_prompts(latin1)
    empty = tmp_path / "empty.yaml"
    empty.write_text("prompts: []\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"empty\.yaml: prompts: List should have at least 1 item"):
        load_eval_prompts(empty)
    with pytest.raises(InputError, match=r"missing\.yaml: file not found"):
        load_eval_prompts(tmp_path / "missing.yaml")
