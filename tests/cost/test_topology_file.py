"""The leveled topology file (planner.cost.topology_file, `planner solve --topology`): devices
numbered through the levels, the link of the highest level where two devices differ, overrides,
and one-line errors for bad files."""
import json

import pytest

from planner.cli.main import main as planner_main
from planner.cost.topology_file import topology_from_json

THREE = {"levels": [{"name": "site", "count": 2, "bandwidth": "100MB", "latency": 0.02, "emulate": True},
                    {"name": "host", "count": 2, "bandwidth": "1GB", "latency": 0.001},
                    {"name": "device", "count": 2}],
         "device": {"memory": "16GiB"}, "devices": {"5": {"speed": 0.5}, "6": {"memory": 1000}}}


def test_devices_links_and_overrides():
    topo = topology_from_json(THREE)
    assert topo.num_devices == 8
    assert topo.position(5) == (1, 0, 1) and topo.position(0) == (0, 0, 0)
    # the highest level where they differ; the innermost level gives no numbers: the defaults
    assert topo.link(0, 1, 7e9, 1e-6) == (7e9, 1e-6)
    assert topo.link(0, 2, 7e9, 1e-6) == (1e9, 0.001)
    assert topo.link(1, 7, 7e9, 1e-6) == (1e8, 0.02)
    assert topo.emulated(3, 4) and not topo.emulated(0, 3)
    assert topo.devices[5].speed == 0.5 and topo.devices[5].memory == 16 * 2 ** 30  # keeps the default memory
    assert topo.devices[6].memory == 1000 and topo.devices[0].speed == 1.0


BAD = [
    ({}, "non-empty \"levels\""),
    ({"levels": []}, "non-empty \"levels\""),
    ({"levels": [{"count": 0}]}, "level 0 needs \"count\""),
    ({"levels": [{"count": 2.5}]}, "level 0 needs \"count\""),
    ({"levels": [{"count": 2, "bandwidth": "fast"}]}, "is not a size"),
    ({"levels": [{"count": 2, "bandwidth": -5}]}, "bandwidth must be positive"),
    ({"levels": [{"count": 2, "latency": -1}]}, "latency must be a non-negative number"),
    ({"levels": [{"count": 2, "emulate": "yes"}]}, "\"emulate\" must be true or false"),
    ({"levels": [{"count": 2, "name": ["a"]}]}, "level 0 \"name\" must be a non-empty string"),
    ({"levels": [{"count": 2, "bandwith": "1GB"}]}, "unknown key\\(s\\) bandwith"),
    ({"levels": [{"count": 2, "name": "a"}, {"count": 2, "name": "a"}]}, "distinct names"),
    ({"levels": [{"count": 2}], "device": {"speed": 0}}, "speed must be a positive number"),
    ({"levels": [{"count": 2}], "device": {"speed": 1e-300}}, "speed is relative to the profiled device, 0.001 to 1000"),
    ({"levels": [{"count": 2}], "devices": {"2": {"speed": 1}}}, "not a device index 0..1"),
    ({"levels": [{"count": 2}], "devices": {"x": {}}}, "not a device index"),
    ({"levels": [{"count": 2}], "devices": {"1": 3}}, "device 1 must be an object"),
    ({"levels": [{"count": 2}], "sites": 2}, "unknown key\\(s\\) sites"),
    ({"levels": [{"count": 100}, {"count": 100}]}, "at most 4096"),
]


@pytest.mark.parametrize("raw,message", BAD)
def test_bad_topology_files_are_refused(raw, message):
    with pytest.raises(ValueError, match=message):
        topology_from_json(raw)


def test_the_command_says_what_is_wrong_in_one_line(tmp_path, capsys):
    from tests.support.synthetic import synthetic_profile
    from planner.profile.profile import save_profile

    profile = str(tmp_path / "p.json")
    save_profile(synthetic_profile([0.01] * 4, [0.02] * 4, [0] * 4, [0] * 4, [1 << 10] * 3, sizes=(1,)), profile)
    bad = tmp_path / "topo.json"
    bad.write_text(json.dumps({"levels": [{"count": 2, "latency": "slow"}]}))
    plan = tmp_path / "plan.json"
    assert planner_main(["solve", profile, "--topology", str(bad), "-o", str(plan)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "level 0 latency" in err and "Traceback" not in err

    def refused(*args, says):
        assert planner_main(["solve", profile, *args, "-o", str(plan)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and says in err and "Traceback" not in err, err

    bad.write_text("{not json")
    refused("--topology", str(bad), says="topo.json")
    refused("--topology", str(tmp_path / "missing.json"), says="missing.json")
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"levels": [{"count": 2, "bandwidth": "1MB", "latency": 0.01}, {"count": 2}]}))
    refused("--topology", str(good), "--devices", "2", says="--devices")
    before = good.read_text()  # the twenty-sixth session's fuzz: `-o` the topology file replaced it with the plan
    assert planner_main(["solve", profile, "--topology", str(good), "--stages", "2", "--global-batch", "4",
                         "-o", str(good)]) == 2
    assert "which this command reads or writes" in capsys.readouterr().err and good.read_text() == before
    refused("--topology", str(good), "--replicate", says="--replicate")
    assert planner_main(["solve", profile, "--topology", str(good), "--local-sgd-max", "2", "-o", str(plan)]) == 2
    assert "local SGD is not planned on a --topology" in capsys.readouterr().err
    assert not plan.exists()
    capsys.readouterr()
    # a good file: the plan says where each replica's ranks run
    assert planner_main(["solve", profile, "--topology", str(good), "--stages", "2", "--global-batch", "4",
                         "-o", str(plan)]) == 0
    written = json.loads(plan.read_text())
    assert written["pipeline_stages"] == 2 and written["data_parallel"] == 2
    assert sorted(x for row in written["placement"] for x in row) == [0, 1, 2, 3]
    assert "placement (device of each pipeline rank)" in capsys.readouterr().out


def test_the_cluster_file_reads_sizes_by_the_same_rule():
    from planner.cost.cluster import cluster_from_json

    def with_bandwidth(value):
        return {"groups": [{"devices": 1}, {"devices": 1}], "links": [{"bandwidth": value, "latency": 0.0}]}

    assert cluster_from_json(with_bandwidth("100MB")).links[0].bandwidth == 1e8
    for bad in ([1], True, float("inf"), 1e-300, "1B"):  # a list was a TypeError traceback; true and inf were
        with pytest.raises(ValueError, match="link 0 bandwidth"):  # accepted; 1e-300 an IndexError in the solver
            cluster_from_json(with_bandwidth(bad))


@pytest.mark.parametrize("raw,message", [
    # a misspelt key read as absent dropped what it set (the memory cap: a plan that "fits" would not)
    ({"groups": [{"devices": 1, "memroy": "8GiB"}, {"devices": 1}], "links": [{"bandwidth": 1e9}]},
     "cluster group 0 has unknown key\\(s\\) memroy; known: bandwidth, devices, latency, memory, name, speed"),
    ({"groups": [{"devices": 1}, {"devices": 1}], "links": [{"bandwidth": 1e9, "emulated": True}]},
     "cluster link 0 has unknown key\\(s\\) emulated"),
    ({"groups": [{"devices": 2}], "link": []}, "cluster file has unknown key\\(s\\) link"),
    # a number past an exabyte (the option and a size string were refused, a number was not)
    ({"groups": [{"devices": 2, "memory": 1e300}]}, "group 0 memory must be at most 1e\\+18"),
    # JSON true is a Python int: it was one device
    ({"groups": [{"devices": True}, {"devices": 1}]}, "cluster group 0 needs \"devices\": a positive integer"),
    # any JSON value was a name (str() of it; a fuzz's minor)
    ({"groups": [{"devices": 1}, {"devices": 1, "name": {"x": 1}}], "links": [{"bandwidth": 1e9}]},
     "cluster group 1 \"name\" must be a non-empty string"),
])
def test_bad_cluster_files_are_refused(raw, message):
    from planner.cost.cluster import cluster_from_json

    with pytest.raises(ValueError, match=message):
        cluster_from_json(raw)


def test_a_topology_memory_past_an_exabyte_is_refused():
    with pytest.raises(ValueError, match="\"device\" memory must be at most 1e\\+18"):
        topology_from_json({"levels": [{"count": 2}], "device": {"memory": 1e19}})


def test_a_link_latency_past_an_hour_is_refused_in_both_files_and_on_the_command_line(tmp_path):
    from planner.cost.cluster import cluster_from_json
    from planner.cost.topology_file import topology_from_json

    # 1e30 s was an IndexError in the solver, 1e308 a PulpError (NaN/inf)
    for value in (1e30, 1e308, 3601):
        with pytest.raises(ValueError, match="latency is seconds per message, 0 to 3600"):
            cluster_from_json({"groups": [{"devices": 1}, {"devices": 1}], "links": [{"bandwidth": 1e9,
                                                                                      "latency": value}]})
        with pytest.raises(ValueError, match="latency is seconds per message, 0 to 3600"):
            topology_from_json({"levels": [{"count": 2, "latency": value}]})


def test_the_cluster_file_reads_speeds_and_latencies_by_the_topology_files_rule():
    from planner.cost.cluster import cluster_from_json

    def cluster(group=None, link_latency=0.0):
        return {"groups": [dict({"devices": 1}, **(group or {})), {"devices": 1}],
                "links": [{"bandwidth": 1e9, "latency": link_latency}]}

    assert cluster_from_json(cluster({"speed": 2, "latency": 1e-4})).groups[0].speed == 2.0
    # a list was a TypeError traceback, "slow" Python's own message, NaN accepted
    for bad in ([1], "slow", float("nan"), -1.0, True):
        with pytest.raises(ValueError, match="cluster group 0 latency must be a non-negative number"):
            cluster_from_json(cluster({"latency": bad}))
        with pytest.raises(ValueError, match="cluster link 0 latency must be a non-negative number"):
            cluster_from_json(cluster(link_latency=bad))
    for bad in ([1], "fast", float("nan"), 0, True):
        with pytest.raises(ValueError, match="cluster group 0 speed must be a positive number"):
            cluster_from_json(cluster({"speed": bad}))
