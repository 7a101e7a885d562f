"""Loads shared by a process group (``group=``): each byte any rank needs is read from storage by one rank.

Real gloo ranks (tests/group_worker.py), each format, against eager + load_state_dict, torchtitan's
set_model_state_dict path and the same load without a group; the bytes every rank read from storage summed
over the group equal the bytes the union of the ranks needs, and a failed read fails every rank alike."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import materialize as mz
from materialize.io.groupread import _Chunk, _refuse_other_files, _refuse_without_cpu, _rounds, _schedule, cut
from materialize.checkpoint.base import TensorInfo
from materialize.checkpoint.pieces import Job

from conftest import reference_model, run_ranks, saved_state, write_safetensors

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without torch.distributed")
WORKER = Path(__file__).with_name("group_worker.py")
RECIPE = Path(__file__).with_name("group_recipe.py")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from sharded_worker import reference_mlp

    made = tmp_path_factory.mktemp("group")
    state = saved_state(reference_model())
    write_safetensors(state, made / "model.safetensors")
    torch.save(state, made / "model.pt")
    with pytest.warns(UserWarning):  # DCP saving outside a process group says so
        dcp.save(dict(state), checkpoint_id=made / "dcp")
    write_safetensors(saved_state(reference_mlp()), made / "mlp.safetensors")
    tied = reference_model(tie=True).state_dict()
    write_safetensors({name: value.clone() for name, value in tied.items()}, made / "tied.safetensors")  # both names
    return made


def _model_bytes() -> int:
    return sum(t.numel() * t.element_size() for t in saved_state(reference_model()).values())


def test_four_ranks_share_reads_of_a_replicated_model_hsdp_and_the_2d_layout(folder, tmp_path):
    ranks = run_ranks("replicated,hsdp,tp_fsdp", folder, tmp_path / "run", world=4, worker=WORKER)

    whole = _model_bytes()
    for kind in ("safetensors", "torch", "dcp"):
        # A plain model on every rank: each tensor as eager + load_state_dict makes it; the checkpoint read once.
        for rank in ranks:
            got = rank["replicated"][kind]
            assert got["same"] and all(got["same"].values()), (kind, got["same"])
            assert got["alone_read"] == whole and got["alone_received"] == 0 and got["alone_collectives"] == []
        reads = [rank["replicated"][kind]["bytes_read"] for rank in ranks]
        received = [rank["replicated"][kind]["received"] for rank in ranks]
        assert sum(reads) == whole, (kind, reads)  # 1.00x: not 4x
        assert all(read > 0 for read in reads), reads  # spread over the ranks, not all on rank 0
        assert max(reads) - min(reads) <= whole // 4, reads
        assert [read + got for read, got in zip(reads, received)] == [whole] * 4  # the rest from the others

        # HSDP 2x2: each rank's shard as the load without a group makes it; storage bytes those of one replica.
        for rank in ranks:
            got = rank["hsdp"][kind]
            assert all(got["locals_equal"].values()) and got["whole_equal"], kind
        union = sum(rank["hsdp"][kind]["alone_read"] for rank in ranks if rank["hsdp"]["replica"] == 0)
        assert sum(rank["hsdp"][kind]["bytes_read"] for rank in ranks) == union == whole, kind

        # torchtitan's 2-D layout: every byte read once, where alone the TP ranks read norms and spans again.
        for rank in ranks:
            assert all(rank["tp_fsdp"][kind]["equal"].values()), (kind, rank["tp_fsdp"][kind]["equal"])
        assert sum(rank["tp_fsdp"][kind]["bytes_read"] for rank in ranks) == whole, kind
        assert sum(rank["tp_fsdp"][kind]["alone_read"] for rank in ranks) > whole, kind
    tied_bytes = (folder / "tied.safetensors").stat().st_size
    for rank in ranks:
        assert all(rank["replicated"]["tied"]["same"].values()) and rank["replicated"]["tied"]["tied"]
    assert 0 < sum(rank["replicated"]["tied"]["bytes_read"] for rank in ranks) < tied_bytes
    for rank in ranks:
        shared, eager = rank["replicated"]["losses"]
        assert shared == eager  # three steps, bit for bit
        assert rank["hsdp"]["losses"][0] == rank["hsdp"]["losses"][1]
        assert rank["tp_fsdp"]["losses"][0] == rank["tp_fsdp"]["losses"][1]


@pytest.mark.long  # group reads on a 3-D mesh of eight ranks; on four (HSDP, 2-D): the test above
def test_eight_ranks_on_a_2x2x2_mesh_read_each_byte_once(folder, tmp_path):
    ranks = run_ranks("mesh3d,replicated", folder, tmp_path / "run", world=8, worker=WORKER)

    from sharded_worker import reference_mlp
    mlp_bytes = sum(t.numel() * t.element_size() for t in reference_mlp().state_dict().values())
    for rank in ranks:
        assert all(rank["mesh3d"]["locals_equal"].values()) and rank["mesh3d"]["whole_equal"]
        assert rank["mesh3d"]["losses"][0] == rank["mesh3d"]["losses"][1] and all(rank["mesh3d"]["trained_equal"].values())
        assert all(rank["replicated"]["safetensors"]["same"].values())
    assert sum(rank["mesh3d"]["bytes_read"] for rank in ranks) == mlp_bytes
    assert sum(rank["mesh3d"]["alone_read"] for rank in ranks) > mlp_bytes
    assert sum(rank["replicated"]["torch"]["bytes_read"] for rank in ranks) == _model_bytes()


def test_a_read_failing_on_one_rank_fails_every_rank_with_the_same_error(folder, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())

    ranks = run_ranks("failure", copy, tmp_path / "run", world=4, worker=WORKER)

    errors = [rank["failure"] for rank in ranks]
    assert errors[0]["error"] is not None and all(error == errors[0] for error in errors), errors
    assert errors[0]["path"] == str(copy / "model.safetensors") and errors[0]["tensor"]
    assert "file ends at byte" in errors[0]["message"] and "of the group" in errors[0]["message"]
    assert "\n" not in errors[0]["message"] and errors[0]["left_on_meta"]


def test_a_rank_that_never_calls_the_load_fails_the_others_after_the_groups_timeout(folder, tmp_path):
    ranks = run_ranks("absent", folder, tmp_path / "run", world=3, worker=WORKER)

    called = [rank["absent"] for rank in ranks if rank["absent"]["called"]]
    assert len(called) == 2
    for got in called:
        assert got["error"] == "CheckpointAccessError" and got["left_on_meta"]
        assert got["message"].startswith("the group's ranks did not all start the load") and "\n" not in got["message"]


def test_two_torchrun_launchers_as_two_nodes_run_the_documented_recipe(folder, tmp_path):
    llama = tmp_path / "checkpoints" / "llama"
    llama.mkdir(parents=True)
    (llama / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    out = tmp_path / "out"
    out.mkdir()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launchers = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank",
         str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), str(RECIPE), str(out)],
        cwd=tmp_path, env={**os.environ, "GROUP_NODE": str(node), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    logs = [launcher.communicate(timeout=300)[0] for launcher in launchers]

    assert [launcher.returncode for launcher in launchers] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(4)]
    assert sorted(r["node"] for r in ranks) == ["0", "0", "1", "1"] and all(r["world"] == 4 for r in ranks)
    assert all(r["equal"] for r in ranks)
    assert sum(r["bytes_read"] for r in ranks) == _model_bytes()
    assert all(r["bytes_read"] + r["received"] == _model_bytes() for r in ranks)


def test_ranks_loading_a_url_together_ask_the_server_for_each_byte_once(tmp_path):
    from group_worker import big_linear
    from remote_servers import RangeServer, byte_range

    for name in ("alone", "shared"):
        (tmp_path / "www" / name).mkdir(parents=True)
        write_safetensors(dict(big_linear().state_dict()), tmp_path / "www" / name / "model.safetensors")
    weights = sum(t.numel() * t.element_size() for t in big_linear().state_dict().values())
    size = (tmp_path / "www" / "alone" / "model.safetensors").stat().st_size
    with RangeServer(tmp_path / "www") as server:
        ranks = run_ranks("remote", server.url, tmp_path / "run", world=3, worker=WORKER)
        sent = {name: 0 for name in ("alone", "shared")}
        for request in server.requests:
            if request.method == "GET":
                first, last = byte_range(request.range, size) or (0, size - 1)
                sent[request.path.split("/")[1]] += last - first + 1

    for rank in ranks:
        assert all(rank["remote"]["alone"]["same"].values()) and all(rank["remote"]["shared"]["same"].values())
    assert sum(rank["remote"]["shared"]["bytes_read"] for rank in ranks) == weights
    assert sent["alone"] >= 3 * weights  # every rank asked for every byte
    assert weights <= sent["shared"] <= weights + 3 * 256 * 1024  # once, beside each rank's read of the header


def _info(shape, offset=0, stride=None):
    return TensorInfo("w", "float32", 4, shape, Path("m.safetensors"), offset, stride=stride)


def test_cut_pieces_span_at_most_the_bound_and_cover_the_job_exactly():
    dest = torch.empty(10, 8)
    pieces = cut(Job(dest, _info((10, 8))), 3 * 32)  # three rows a piece
    assert [p.info.offset for p in pieces] == [0, 96, 192, 288] and sum(p.info.numel for p in pieces) == 80
    assert all(p.dest.data_ptr() == dest.data_ptr() + p.info.offset for p in pieces)

    box = torch.empty(10, 8)[:, 4:]  # a row-wise parallel box: every row's right half
    strided = cut(Job(box, TensorInfo("w", "float32", 4, (10, 4), Path("m"), 16, stride=(8, 1))), 100)
    spans = [((p.info.shape[0] - 1) * 8 + 4) * 4 for p in strided]
    assert all(span <= 100 for span in spans) and sum(p.info.shape[0] for p in strided) == 10
    assert [p.info.offset for p in strided] == [16 + 32 * 3 * i for i in range(len(strided))]


def test_the_schedule_gives_each_byte_one_reader_among_the_ranks_needing_it():
    needs = [{0: [(0, 100)]}, {0: [(50, 150)]}, {0: [(0, 150)]}, {}]
    chunks = _schedule(needs, 40)
    covered = sorted((c.start, c.end) for c in chunks)
    assert covered[0][0] == 0 and covered[-1][1] == 150
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # no byte twice, none left out
    for chunk in chunks:
        assert chunk.owner in chunk.audience and chunk.end - chunk.start <= 40
        assert set(chunk.audience) == {r for r, n in enumerate(needs) for s, e in n.get(0, []) if s < chunk.end and e > chunk.start}
    for turn in _rounds(chunks):
        assert len({c.owner for c in turn}) == len(turn)


def test_ranks_seeing_files_of_other_sizes_are_refused_naming_the_file():
    gathered = [({"/ckpt/model.safetensors": 100}, {}), ({"/ckpt/model.safetensors": 90}, {})]
    with pytest.raises(mz.CheckpointError, match=r"model\.safetensors: the ranks of the group see different files .*rank 1: 90 bytes"):
        _refuse_other_files(gathered, ["/ckpt/model.safetensors"])


def test_a_group_without_a_cpu_backend_is_refused_with_the_gloo_hint():
    class Nccl:
        @staticmethod
        def get_backend(group):
            return "nccl"

    with pytest.raises(mz.CheckpointError, match=r"new_group\(backend='gloo'\)"):
        _refuse_without_cpu(Nccl, object())
