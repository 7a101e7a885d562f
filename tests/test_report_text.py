"""The report says what its sizes are: a sharded rank's share, and why more bytes were read than the model
holds, where they were.

The table's labels are tested on report objects made here (a sharded rank's, a plain load's); the reasons
on small single-process loads that read beyond the model each one way (a narrowing cast, a tied copy read
to compare, a strided view read whole). A sharded load's report is checked by the tensor-parallel test
of ``test_sharded.py``, which runs ranks anyway.
"""

from __future__ import annotations

import re

import torch
from torch import nn

import materialize as mz
from materialize.report import Report
from materialize.sizes import format_bytes


def row(text: str, label: str) -> str:
    """The value of the table row ``label`` (the label whole, up to the two spaces before the value)."""
    return re.search(rf"^{re.escape(label)}\s{{2,}}(.*)$", text, re.M).group(1)


def test_a_ranks_report_labels_its_share_and_says_why_it_read_more():
    report = Report(checkpoint="ckpt", format="torch", device="cpu", model_bytes=1000, bytes_read=1500, rank_share=True,
                    read_beyond_model=["whole rows read around the columns this rank's shards take (500 B)"])

    text = str(report)

    assert row(text, "model size (this rank's share)") == format_bytes(1000)
    assert row(text, "bytes read (by this rank)") == (f"{format_bytes(1500)} (more than the model size: whole rows read "
                                                      "around the columns this rank's shards take (500 B))")
    assert report.to_dict()["rank_share"] is True
    assert report.to_dict()["read_beyond_model"] == report.read_beyond_model


def test_a_plain_reports_labels_stay_as_they_were():
    text = str(Report(checkpoint="ckpt", format="torch", device="cpu", model_bytes=1000, bytes_read=1000))

    assert row(text, "model size") == row(text, "bytes read") == format_bytes(1000)
    assert "share" not in text and "more than" not in text


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight


def test_a_narrowing_cast_is_the_reason_given_with_its_bytes(tmp_path):
    torch.save({"weight": torch.randn(16, 8), "bias": torch.randn(16)}, tmp_path / "fp32.pt")
    with mz.meta_init():
        model = nn.Linear(8, 16)

    report = mz.load(model, tmp_path / "fp32.pt", dtype="fp16")

    assert report.bytes_read - report.model_bytes == (16 * 8 + 16) * 2
    assert report.read_beyond_model == [f"casts to a narrower dtype ({(16 * 8 + 16) * 2} B)"]
    assert "more than the model size: casts to a narrower dtype" in row(str(report), "bytes read")


def test_a_tied_copy_read_to_compare_is_the_reason_given(tmp_path):
    weight = torch.randn(8, 4)
    torch.save({"embed.weight": weight, "head.weight": weight.clone()}, tmp_path / "two_copies.pt")  # equal, apart
    with mz.meta_init():
        model = Tied()

    report = mz.load(model, tmp_path / "two_copies.pt")

    assert model.head.weight is model.embed.weight and report.bytes_read - report.model_bytes == 8 * 4 * 4
    assert report.read_beyond_model == [f"a tied tensor's other copies read to compare with the first ({8 * 4 * 4} B)"]


def test_a_strided_view_read_whole_is_the_reason_given(tmp_path):
    whole = torch.randn(4, 8)
    torch.save({"weight": whole[:, :2]}, tmp_path / "view.pt")  # the file holds the whole storage
    model = nn.Module()
    with mz.meta_init():
        model.register_parameter("weight", nn.Parameter(torch.empty(4, 2)))

    report = mz.load(model, tmp_path / "view.pt")

    assert torch.equal(model.weight, whole[:, :2])
    beyond = report.bytes_read - report.model_bytes
    assert beyond > 0 and report.read_beyond_model == [f"the spans of strided views read whole ({beyond} B)"]
