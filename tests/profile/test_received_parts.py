"""The storages a unit's arguments view apart (UnitProfile.received_parts, received_saved_parts): measured on a
Glow-like flow's coupling, written and read back, bad values refused, older files read without them."""
import json

import pytest

from planner.jsonio import JsonFileError
from planner.profile.profile import Profile
from tests.support.runs import profile_of


def test_a_couplings_views_are_measured_as_a_stage_receives_them():
    # net_in reads a = x[:, :3] and saves it, net_out neither view, affine saves b = x[:, 3:]: inside a stage one
    # storage of 48 bytes (b = 2, 6 features), which a stage starting at any of them receives as 24 + 24
    profile = profile_of("tests.flow_models:glow", sizes=(2,))
    names = [u.name for u in profile.units]
    net_in, net_out, affine = (profile.units[names.index(n)] for n in ("net_in.1", "net_out.1", "affine.1"))
    (storage, views), = net_in.received_parts[2].items()
    assert sorted(views.values()) == [24, 24] and net_in.shared_saved_bytes[2][storage] == 48
    a, b = sorted(views)
    assert net_out.received_parts[2] == affine.received_parts[2] == {storage: views}
    assert net_in.received_saved_parts[2] == {storage: {a: 24}} and affine.received_saved_parts[2] == {storage: {b: 24}}
    assert net_out.received_saved_parts[2] == {}
    # written and read back; units whose arguments arrive as inside a stage record none
    again = Profile.from_json(json.loads(json.dumps(profile.to_json())))
    assert [u.received_parts for u in again.units] == [u.received_parts for u in profile.units]
    assert [u.received_saved_parts for u in again.units] == [u.received_saved_parts for u in profile.units]
    assert not profile.units[0].received_parts and not profile.units[0].first_saved_bytes


def test_bad_views_are_refused_and_an_older_file_reads_without_them():
    profile = profile_of("tests.flow_models:glow", sizes=(2,))
    data = json.loads(json.dumps(profile.to_json()))
    k = [u["name"] for u in data["units"]].index("net_in.1")
    unit = data["units"][k]
    (storage, views), = unit["received_parts"]["2"].items()
    a = next(iter(unit["received_saved_parts"]["2"][storage]))
    bad = [("received_parts", {"2": {storage: {a: -1}}}, "received_parts"),
           ("received_parts", {"2": {storage: {}}}, "is empty"),
           ("received_parts", {"2": [24]}, "expected an object"),
           ("received_saved_parts", {"2": {storage: {a: 23}}}, "that received_parts does not"),
           ("received_saved_parts", {"2": {"elsewhere": {a: 24}}}, "shared_saved_bytes does not")]
    for field, value, message in bad:
        broken = json.loads(json.dumps(data))
        broken["units"][k][field] = value
        with pytest.raises(JsonFileError, match=message):
            Profile.from_json(broken)
    for u in data["units"]:  # an older file: not measured
        u.pop("received_parts", None)
        u.pop("received_saved_parts", None)
    older = Profile.from_json(data)
    assert not any(u.received_parts or u.received_saved_parts for u in older.units)
