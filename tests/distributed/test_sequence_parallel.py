"""Sequence parallelism of the prompt-once path on 2 and 4 ranks (gloo, CPU): every pass split along the sequence
(zigzag, the default; contiguous shards in one case).

Each run (``sp_worker.py``) scores a window of three micro-batches (a 71-token shared system prompt, a group split over
two micro-batches, prompt widths odd and even) on both ranks of a sequence-parallel group and asserts that the log-probs
and entropies equal stock TRL's on one process within 1e-5, that the parameter gradients summed over the ranks equal
stock's within 1e-5 of each parameter's largest, that each rank's recorded K/V of every pass have the heads the
exchange keeps (1/size of the pass's under the head exchange, the default; whole under the all-gather one), that ranks
given different micro-batches both raise the named cause (no hang), and, for Llama, that the MoE router loss and a
model with linear-attention layers are refused by cause.
"""

from launch import launch

CASES = [
    ("llama", "tree", "checkpointing"),  # TRL's default non-reentrant checkpointing: the all-gathers re-run in backward
    # the cpu backend's own region without a mask tensor (what long shards take), forced: nodes of four lengths in one
    # pass, so some rows' shards are all padding
    ("llama", "tree", "causal"),
    ("llama", "group", ""),
    ("mistral", "tree", ""),  # sliding window shorter than the prompts
    ("gpt_oss", "tree", ""),  # sinks, sliding window, MoE layers
    ("gemma2", "tree", ""),  # attention and final logit soft-capping
    ("deepseek_v3", "tree", ""),  # MLA: value heads narrower than key heads, cut before the exchange
    ("llama", "tree", "contiguous"),  # the contiguous split, kept selectable
    ("llama", "tree", "gather"),  # the all-gather exchange, kept selectable
    ("llama", "tree", "mqa"),  # one K/V head: repeated to 2 by the head exchange, its copies' gradients summed
    ("llama", "tree", "odd-heads"),  # 3 query heads over 2 ranks: the layers run the all-gather exchange
]


def test_sequence_parallel_scoring_matches_stock():
    """Every case of ``CASES`` on one SP group of 2, one after another in one launch of 2 processes (a launch costs
    more than a case: each process imports torch, transformers and TRL); a failing case names its architecture and
    sharing mode in the assertion, and each passed case is printed by rank."""
    args = " + ".join(" ".join(filter(None, case)) for case in CASES)
    out = launch("sp_worker.py", *args.split(), timeout=1200)
    for case in args.split("+"):
        for rank in (0, 1):
            assert f"rank {rank}: {case.strip()} passed" in out, out[-2000:]


def test_sequence_parallel_zigzag_over_four_ranks():
    """One SP group of 4 ranks: each pass cut into 8 chunks (rank r holds chunks r and 7 − r); the head exchange
    repeats the 2 K/V heads to 4, one a rank; log-probs and summed gradients equal stock's."""
    launch("sp_worker.py", "llama", "tree", "one-group", nproc=4)


def test_sequence_parallel_groups_with_data_parallelism():
    """4 ranks: SP groups {0, 1} and {2, 3}, data parallel over them with different windows (other system-prompt
    lengths, so the groups' passes differ); each group's log-probs and summed gradients equal stock's on its data."""
    launch("sp_worker.py", "llama", "tree", nproc=4)
