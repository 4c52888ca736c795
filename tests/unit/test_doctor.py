"""ddpkit doctor's checks, each triggered by a crafted environment, facts or files."""

from __future__ import annotations

import socket

import pytest

from ddpkit.common.network import infiniband_devices
from ddpkit.doctor import checks, script
from ddpkit.doctor.facts import Facts, Gpu, shm_size, watched


def findings(facts: Facts | None = None, **env: str) -> list[checks.Finding]:
    return checks.run_all(facts or Facts(interfaces={"lo": ["127.0.0.1"], "eth0": []}), env)


def only(found: list[checks.Finding], check: str) -> list[checks.Finding]:
    return [f for f in found if f.check == check]


def gpus(n: int, **kw) -> list[Gpu]:
    return [Gpu(i, "H200", 143771, f"0000:00:0{i}.0", **kw) for i in range(n)]


def test_a_clean_environment_has_no_findings():
    assert findings() == []


def test_malformed_rank_is_an_error_with_the_env_fix():
    (f,) = only(findings(RANK="0,1", WORLD_SIZE="2"), "variables")
    assert f.level == "error"
    assert "RANK='0,1' is not one integer" in f.what
    assert "ddpkit run" in f.fix


def test_rank_beyond_world_size_is_an_error():
    (f,) = only(findings(RANK="3", WORLD_SIZE="2"), "variables")
    assert "RANK=3 but the job has only 2" in f.what


def test_local_rank_beyond_visible_gpus_is_an_error():
    facts = Facts(gpus=gpus(2))
    (f,) = only(findings(facts, RANK="2", WORLD_SIZE="3", LOCAL_RANK="2"), "variables")
    assert "LOCAL_RANK=2 but only 2 GPU(s)" in f.what


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("CUDA_VISIBLE_DIVICE", "CUDA_VISIBLE_DEVICES"),
        ("NCCL_DEBUGG", "NCCL_DEBUG"),
        ("MASTER_ADRR", "MASTER_ADDR"),
        ("WORLD_SIZ", "WORLD_SIZE"),
        ("NCCL_SOCKET_IFNAM", "NCCL_SOCKET_IFNAME"),
    ],
)
def test_misspelt_variables_are_named_with_the_right_name(typo, meant):
    (f,) = only(findings(**{typo: "1"}), "spelling")
    assert f.level == "warning"
    assert f"misspelling of {meant}" in f.what
    assert f"export {meant}=" in f.fix


def test_unrelated_variables_are_not_called_misspelt():
    assert not only(findings(HOME="/root", EDITOR="vi", PYTHONPATH="x", LANG="C"), "spelling")


def test_visible_devices_naming_missing_or_repeated_gpus_are_errors():
    facts = Facts(gpus=gpus(2))
    missing = only(findings(facts, CUDA_VISIBLE_DEVICES="0,3"), "devices")
    assert ["names GPU 3" in f.what for f in missing] == [True]
    repeated = only(findings(facts, CUDA_VISIBLE_DEVICES="1,1"), "devices")
    assert ["repeats GPU 1" in f.what for f in repeated] == [True]


def test_a_privileged_master_port_is_a_warning():
    found = only(findings(MASTER_PORT="1010"), "port")
    assert any(f.level == "warning" and "privileged" in f.what for f in found)


def test_a_master_port_in_use_is_an_error_naming_the_holder():
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        (f,) = [f for f in only(findings(MASTER_PORT=str(port)), "port") if f.level == "error"]
    assert f"MASTER_PORT={port} is already in use" in f.what
    assert "python" in f.what


def test_a_master_addr_on_the_debian_hostname_loopback_is_flagged():
    found = only(
        findings(
            MASTER_ADDR="127.0.1.1",
            WORLD_SIZE="4",
            LOCAL_WORLD_SIZE="2",
            RANK="0",
            MASTER_PORT="29500",
        ),
        "address",
    )
    assert found[0].level == "error"
    assert "127.0.1.1" in found[0].what


def test_a_master_addr_that_does_not_resolve_is_an_error():
    (f,) = only(findings(MASTER_ADDR="no-such-host.invalid"), "address")
    assert "does not resolve" in f.what


def test_small_dev_shm_is_an_error_with_several_gpus():
    (f,) = only(findings(Facts(shm_bytes=64 * 2**20, gpus=gpus(2))), "shm")
    assert f.level == "error"
    assert "--shm-size" in f.fix


def test_shm_and_infiniband_are_read_from_the_files(tmp_path):
    assert shm_size(str(tmp_path)) > 0
    (tmp_path / "mlx5_0").mkdir()
    assert infiniband_devices(str(tmp_path)) == ["mlx5_0"]
    assert infiniband_devices(str(tmp_path / "none")) == []


@pytest.mark.parametrize("name", ["NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE"])
def test_nccl_switches_that_slow_things_down_are_warnings(name):
    (f,) = only(findings(**{name: "1"}), "nccl")
    assert f.level == "warning"


def test_nvls_off_is_only_information():
    (f,) = only(findings(NCCL_NVLS_ENABLE="0"), "nccl")
    assert f.level == "info"


def test_a_socket_interface_that_does_not_exist_is_an_error():
    (f,) = only(findings(NCCL_SOCKET_IFNAME="ib9"), "nccl")
    assert "matches no network interface" in f.what
    assert not only(findings(NCCL_SOCKET_IFNAME="eth"), "nccl"), "a prefix of eth0 is fine"
    assert not only(findings(GLOO_SOCKET_IFNAME="lo"), "nccl")


def test_low_memlock_with_infiniband_is_a_warning():
    facts = Facts(infiniband=["mlx5_0"], memlock_bytes=64 * 1024)
    (f,) = only(findings(facts), "memlock")
    assert "ulimit -l unlimited" in f.fix
    assert not only(findings(Facts(infiniband=["mlx5_0"], memlock_bytes=None)), "memlock")


def test_gpu_pairs_without_peer_access_busy_gpus_and_old_drivers_are_found():
    facts = Facts(
        gpus=gpus(2, processes=[4242]),
        peer_access={"0-1": False},
        torch="2.11",
        torch_cuda="13.0",
        driver_cuda="12.4",
        nccl_built=True,
    )
    found = findings(facts)
    assert only(found, "p2p")[0].what.startswith("GPUs 0 and 1 cannot access")
    assert len(only(found, "busy")) == 2
    assert "supports CUDA up to 12.4" in only(found, "driver")[0].what


def test_torch_without_nccl_on_a_gpu_machine_is_an_error():
    facts = Facts(gpus=gpus(1), torch="2.13.0+cpu", nccl_built=False)
    assert only(findings(facts), "nccl")[0].level == "error"


def test_oversubscribed_threads_are_a_warning():
    facts = Facts(cpu_cores=16, gpus=gpus(8))
    (f,) = only(findings(facts, OMP_NUM_THREADS="8"), "threads")
    assert "64 threads on 16 cores" in f.what
    assert "OMP_NUM_THREADS=2" in f.fix


def test_watched_variables_are_the_distributed_ones():
    assert watched("NCCL_DEBUG")
    assert watched("MASTER_ADDR")
    assert not watched("HOME")


CLASSIC = """import os, subprocess, torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
subprocess.run(["python", "-m", "torch.distributed.launch", "--nproc_per_node=3", "t.py"])
rank = int(os.environ["RANK"])
dist.init_process_group("nccl")
model = DDP(torch.nn.Linear(2, 2).cuda(), device_ids=[rank])
sampler = torch.utils.data.DistributedSampler(range(10))
"""


def test_a_script_scan_points_at_each_classic_mistake(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(CLASSIC)
    found = {f.what.split(" ")[0] + "@" + f.where for f in script.scan(str(path))}
    assert "device_ids=[rank]@train.py:7" in found
    assert "torch.distributed.launch@train.py:4" in found
    assert "backend@train.py:6" in found
    assert "init_process_group@train.py:6" in found
    assert "DistributedSampler@train.py:8" in found  # without set_epoch


def test_a_clean_ddpkit_script_has_no_script_findings(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("import ddpkit\ns = ddpkit.setup()\nmodel = s.wrap(net)\n")
    assert script.scan(str(path)) == []


def test_an_unreadable_or_invalid_script_is_a_usage_error(tmp_path):
    from ddpkit.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot read"):
        script.scan(str(tmp_path / "missing.py"))
    (tmp_path / "bad.py").write_text("def (:\n")
    with pytest.raises(ConfigError, match="not valid Python"):
        script.scan(str(tmp_path / "bad.py"))


def scan_text(tmp_path, text: str) -> list[str]:
    path = tmp_path / "train.py"
    path.write_text(text)
    return [f.what for f in script.scan(str(path))]


NANOGPT_STYLE = """import os, numpy as np, torch
from torch.distributed import init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
ddp_local_rank = int(os.environ['LOCAL_RANK'])
init_process_group(backend='nccl')
device = f'cuda:{ddp_local_rank}'
torch.cuda.set_device(device)
seed_offset = int(os.environ['RANK'])
torch.manual_seed(1337 + seed_offset)
def get_batch(split):
    data = np.memmap('train.bin', dtype=np.uint16, mode='r')
    ix = torch.randint(len(data) - 1024, (12,))
    return torch.stack([torch.from_numpy(data[i:i+1024].astype(np.int64)) for i in ix])
model = DDP(torch.nn.Linear(2, 2).to(device), device_ids=[ddp_local_rank])
"""


def test_per_rank_sampling_without_a_dataloader_is_not_called_unsharded(tmp_path):
    assert not [w for w in scan_text(tmp_path, NANOGPT_STYLE) if "DistributedSampler" in w]


def test_a_dataloader_without_a_sampler_under_ddp_is_still_found(tmp_path):
    text = NANOGPT_STYLE + "loader = torch.utils.data.DataLoader(range(10), batch_size=2)\n"
    assert "DistributedDataParallel without a DistributedSampler" in scan_text(tmp_path, text)


def test_set_device_index_of_torch_accelerator_counts_as_setting_the_device(tmp_path):
    text = NANOGPT_STYLE.replace(
        "torch.cuda.set_device(device)", "torch.accelerator.set_device_index(ddp_local_rank)"
    )
    assert not [w for w in scan_text(tmp_path, text) if "never set" in w]


def test_a_gloo_cpu_script_needs_no_cuda_device(tmp_path):
    text = "import torch.distributed as dist\ndist.init_process_group('gloo')\n"
    assert not [w for w in scan_text(tmp_path, text) if "never set" in w]


def test_torch_distributed_launch_in_a_comment_or_docstring_is_not_a_finding(tmp_path):
    text = '"""Once run with torch.distributed.launch; now torchrun."""\n'
    text += "# we moved off torch.distributed.launch last year\nimport torch\n"
    assert not [w for w in scan_text(tmp_path, text) if "launch" in w]


def test_a_local_rank_argument_that_modern_launchers_never_pass_is_an_error(tmp_path):
    text = """import argparse, torch
parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()
torch.cuda.set_device(args.local_rank)
"""
    assert "the local rank comes from a --local_rank argument" in scan_text(tmp_path, text)


LAUNCHED = """import os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
os.environ["MASTER_PORT"] = "12355"
world_size = 4
dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=world_size)
rank = dist.get_rank()
model = DDP(torch.nn.Linear(2, 2))
if rank == 0:
    dist.barrier()
if rank == 0:
    dist.send(torch.ones(1), 1)
else:
    dist.recv(torch.ones(1), 0)
breakpoint()
torch.save(model.state_dict(), "ckpt.pt")
if rank == 0:
    torch.save(model.state_dict(), "ok.pt")
torch.save(model.state_dict(), f"ckpt_{rank}.pt")
"""


def test_the_mistakes_a_launcher_brings_out_are_found_with_their_lines(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(LAUNCHED)
    found = {f"{f.what} [{f.where}]" for f in script.scan(str(path))}
    assert found == {
        "world_size=4 is written in the script [train.py:7]",
        "barrier() is called only where `rank == 0` [train.py:11]",
        "torch.save runs on every rank [train.py:17]",
        "breakpoint() is in the script [train.py:16]",
        "the script sets MASTER_PORT itself [train.py:5]",
    }, "send/recv across a branch pair up; a save on rank 0 or to a rank's own file is fine"


def test_the_report_says_the_script_was_scanned_even_when_nothing_was_found(tmp_path):
    from ddpkit.cli.doctor import render
    from ddpkit.doctor.facts import gather

    text = render(gather(), [], None, 0, 0, {"path": "train.py", "findings": 0})
    assert "scanned train.py (read, not run): nothing found" in text


def scan_here(tmp_path, text: str, gpus: int) -> list[str]:
    path = tmp_path / "train.py"
    path.write_text(text)
    return [f"{f.level} {f.what}" for f in script.scan(str(path), gpus=gpus)]


def test_on_a_machine_without_a_gpu_every_line_that_will_fail_there_is_an_error(tmp_path):
    said = scan_here(tmp_path, NANOGPT_STYLE, gpus=0)
    assert "error backend 'nccl' is hard-coded and this machine has no GPU" in said
    assert "error torch.cuda.set_device(device) and this machine has no GPU" in said
    assert (
        "error the script sends work to CUDA (f'cuda:{ddp_local_rank}') and this machine has no GPU"
        in said
    )
    assert "error device_ids=[ddp_local_rank] and this machine has no GPU" in said
    guide = "import torch\ndevice = 'cuda'\nx = torch.ones(1).to(device)\n"
    assert scan_here(tmp_path, guide, gpus=0) == [
        "error the script sends work to CUDA ('cuda') and this machine has no GPU"
    ]
    assert scan_here(tmp_path, guide, gpus=1) == [], "on a GPU machine it runs"


def test_cuda_chosen_only_where_it_is_available_is_not_a_finding(tmp_path):
    text = """import os, torch
local_rank = int(os.environ['LOCAL_RANK'])
if torch.cuda.is_available(): torch.cuda.set_device(local_rank)
device = torch.device('cuda', local_rank) if torch.cuda.is_available() else torch.device('cpu')
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Linear(2, 2).to(device),
    device_ids=[local_rank] if torch.cuda.is_available() else None)
"""
    assert scan_here(tmp_path, text, gpus=0) == []


def test_model_module_on_what_s_wrap_returned_is_a_warning_with_unwrap(tmp_path):
    text = (
        "import ddpkit\ns = ddpkit.setup()\nmodel = s.wrap(net)\nsd = model.module.state_dict()\n"
    )
    assert scan_here(tmp_path, text, gpus=1) == ["warning model.module is DDP's attribute"]


def test_a_plain_shuffled_dataloader_beside_s_wrap_is_unsharded(tmp_path):
    text = """import ddpkit, torch
s = ddpkit.setup()
model = s.wrap(torch.nn.Linear(2, 2))
train = torch.utils.data.DataLoader(range(96), batch_size=4, shuffle=True)
"""
    assert scan_here(tmp_path, text, gpus=1) == [
        "warning DistributedDataParallel without a DistributedSampler"
    ]
    assert scan_here(tmp_path, text.replace("torch.utils.data.DataLoader(", "s.loader("), 1) == []
