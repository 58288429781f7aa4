"""SparseLoCo: the outer, data-parallel synchronisation of each pipeline stage.

`codec` (error feedback, chunked top-k, 2-bit quantisation, the versioned wire format), `batch`
(a whole round's blobs validated and decoded at once), `dense` (fp32 format of the baselines),
`aggregate` (median clipping, scatter-mean) and `outer` (the SGD outer step). The gather through object storage lives in `crucible.gather`, the stores in
`crucible.store`.
"""
from crucible.sparseloco._wire import run_tag
from crucible.sparseloco.aggregate import (
    AGGREGATE_MODES,
    aggregate,
    clip_scales,
    tensor_norm_ratios,
)
from crucible.sparseloco.batch import decode_contributions
from crucible.sparseloco.codec import (
    MAX_SCALE,
    MIN_SCALE,
    Contribution,
    ErrorFeedbackCodec,
    InvalidContribution,
    SparseValues,
    contribution_bytes,
    decode_contribution,
    encode_contribution,
    encode_contributions_batched,
)
from crucible.sparseloco.dense import decode_dense, dense_bytes, encode_dense
from crucible.sparseloco.outer import NonFiniteUpdate, OuterSGD

__all__ = [
    "AGGREGATE_MODES", "MAX_SCALE", "MIN_SCALE", "Contribution", "ErrorFeedbackCodec",
    "InvalidContribution", "NonFiniteUpdate", "OuterSGD", "SparseValues", "aggregate",
    "clip_scales", "contribution_bytes", "decode_contribution", "decode_contributions",
    "decode_dense", "dense_bytes", "encode_contribution", "encode_contributions_batched",
    "encode_dense", "run_tag", "tensor_norm_ratios",
]
