"""CS-F-LTR's message kinds and their schemas: the training round's model and update, the
parties' sketch queries and answers (relayed by the server) and the collection statistics."""

from __future__ import annotations

from foltr_async.runtime.schema import Array, Bool, Int, Kind, Str

MODEL = "csfltr.model"
UPDATE = "csfltr.update"
RTK_QUERY = "csfltr.rtk_query"
RTK_ANSWER = "csfltr.rtk_answer"
TF_QUERY = "csfltr.tf_query"
TF_ANSWER = "csfltr.tf_answer"
NAIVE_QUERY = "csfltr.naive_query"
NAIVE_ANSWER = "csfltr.naive_answer"
STATS = "csfltr.stats"
QUERIES = {RTK_QUERY: RTK_ANSWER, TF_QUERY: TF_ANSWER, NAIVE_QUERY: NAIVE_ANSWER}

_REQ = Int(min=0, max=2**62)
_COLS = {"cols": Array("int32", ndim=2), "signs": Array("int8", ndim=2)}
#: its message kinds and their schemas (``PROVIDES`` hands them to ``load_plugins``)
KINDS = (
    Kind(MODEL, {"params": Array("float64", ndim=1, finite=True), "generate": Bool()}),
    Kind(
        UPDATE,
        {
            "params": Array("float64", ndim=1, finite=True),
            "n_queries": Int(min=0),
            "instances": Int(min=0),
        },
    ),
    Kind(RTK_QUERY, {"req": _REQ, "owner": Str(max_len=64), **_COLS}),
    Kind(
        RTK_ANSWER,
        {
            "req": _REQ,
            "ptr": Array("int64"),
            "docs": Array("int32"),
            "counts": Array("float32"),
            "full": Array("bool"),
        },
    ),
    Kind(TF_QUERY, {"req": _REQ, "owner": Str(max_len=64), "docs": Array("int32"), **_COLS}),
    Kind(
        TF_ANSWER,
        {
            "req": _REQ,
            "tf": Array("float32", ndim=4),  # (field, doc, term, row)
            "length": Array("int32", ndim=2),  # (field, doc)
            "unique": Array("int32", ndim=2),
        },
    ),
    Kind(
        STATS,
        {
            "owner": Str(max_len=64),
            "df": Array("float32", ndim=2),  # (field, term)
            "cf": Array("float32", ndim=2),
            "n_docs": Int(min=0),
            "total_len": Array("float64"),  # (field,)
        },
    ),
    Kind(NAIVE_QUERY, {"req": _REQ, "owner": Str(max_len=64), **_COLS}),
    Kind(NAIVE_ANSWER, {"req": _REQ, "values": Array("float32", ndim=2)}),  # (doc, row)
)
