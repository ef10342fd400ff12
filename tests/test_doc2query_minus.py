import numpy as np

from qcg_gpu.indexing.doc2query_minus import keep_count, keep_mask


def test_keep_count_is_a_float_safe_ceiling():
    assert keep_count(0.8, 20) == 16
    assert keep_count(0.7, 10) == 7  # 0.7 * 10 == 7.000000000000001 in floating point
    assert keep_count(0.8, 3) == 3
    assert keep_count(0.2, 4) == 1
    assert keep_count(1.0, 5) == 5
    assert keep_count(0.5, 0) == 0


def test_keep_mask_per_chunk_with_ties_by_generation_order():
    chunk = np.array([0, 0, 0, 0, 0, 1, 1, 2])
    gen = np.array([0, 1, 2, 3, 4, 0, 1, 0])
    score = np.array([0.1, 0.9, 0.5, 0.5, 0.2, 0.3, 0.4, -0.2], dtype=np.float32)
    # chunk 0: m=5, keep ceil(0.5*5)=3: 0.9 (g1), then the 0.5 tie (g2 and g3)
    # chunk 1: m=2, keep 1: g1; chunk 2: m=1, keep 1
    mask = keep_mask(chunk, gen, score, alpha=0.5)
    assert mask.tolist() == [False, True, True, True, False, False, True, True]
    mask = keep_mask(chunk, gen, score, alpha=0.4)  # chunk 0 keeps ceil(2.0)=2: g1, then g2 wins the tie
    assert mask.tolist() == [False, True, True, False, False, False, True, True]


def test_keep_mask_handles_unsorted_rows_and_empty_input():
    chunk = np.array([1, 0, 1, 0])
    gen = np.array([0, 0, 1, 1])
    score = np.array([0.1, 0.2, 0.3, 0.4])
    assert keep_mask(chunk, gen, score, alpha=0.5).tolist() == [False, False, True, True]
    assert keep_mask(np.array([], int), np.array([], int), np.array([]), 0.8).size == 0
