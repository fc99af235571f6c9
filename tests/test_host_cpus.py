"""HostCpus: logical CPUs of the affinity mask, SMT siblings counted as one core, the cgroup quota."""
import os

from offline_paged.core.host_cpus import HostCpus

CPUS = sorted(os.sched_getaffinity(0))


def fake_host(tmp_path, siblings: list[str], cpu_max: str | None = None) -> HostCpus:
    """A /sys whose CPU i (of this process's affinity) lists siblings[i % len(siblings)] as its SMT set."""
    for i, cpu in enumerate(CPUS):
        topology = tmp_path / "sys" / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        topology.joinpath("thread_siblings_list").write_text(siblings[i % len(siblings)] + "\n")
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nmodel name\t: Test CPU 9000\n")
    if cpu_max is not None:
        (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    return HostCpus.read(str(tmp_path / "sys"), str(tmp_path / "cpuinfo"), str(tmp_path / "cpu.max"))


def test_smt_siblings_are_one_core(tmp_path):
    host = fake_host(tmp_path, [",".join(map(str, CPUS))])
    assert host == HostCpus(len(CPUS), 1, "Test CPU 9000", None)
    assert host.usable_cores() == 1


def test_one_thread_a_core_counts_every_cpu(tmp_path):
    host = fake_host(tmp_path, [str(cpu) for cpu in CPUS])
    assert (host.physical_cores, host.usable_cores()) == (len(CPUS), len(CPUS))


def test_the_quota_caps_the_cores_rounded_up(tmp_path):
    host = HostCpus(cpus=64, physical_cores=32, cpu_model=None, quota_cpus=2.5)
    assert host.usable_cores() == 3
    assert HostCpus(64, 32, None, 0.1).usable_cores() == 1
    assert HostCpus(64, 32, None, 100.0).usable_cores() == 32
    assert fake_host(tmp_path, ["0"], "250000 100000").quota_cpus == 2.5


def test_no_quota_and_unreadable_files_are_none(tmp_path):
    assert fake_host(tmp_path / "a", ["0"], "max 100000").quota_cpus is None
    assert fake_host(tmp_path / "b", ["0"], "garbage").quota_cpus is None
    assert fake_host(tmp_path / "c", ["0"], "100000 0").quota_cpus is None
    host = HostCpus.read(str(tmp_path / "none"), str(tmp_path / "none"), str(tmp_path / "none"))
    assert host.physical_cores is None and host.quota_cpus is None
    assert host.usable_cores() == len(CPUS)  # the logical CPUs, where /sys does not say


def test_the_bench_record_names_every_field():
    assert set(HostCpus(4, 2, "x", None).record()) == {"cpus", "physical_cores", "cpu_model", "quota_cpus"}
