"""The profile in the plan's compute dtype: byte counts of another dtype's profile scaled by the ratio of
the dtypes' sizes (times as measured); a profile measured at the plan's precision taken as measured."""
from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

from planner.cost import memory as memory_model
from planner.cost.options import CostOptions
from planner.cost.rank_memory import precision_of
from planner.profile.cut_profile import CutProfile, CutValue
from planner.profile.profile import Profile
from planner.profile.unit_profile import UnitProfile


_CONVERTED: Dict[Tuple[int, str], Tuple[Profile, Profile]] = {}  # (id(profile), precision) -> both


def compute_profile(profile: Profile, opts: CostOptions) -> Profile:
    """The profile with its byte counts in the precision's compute dtype (parameters, saved
    activations, outputs and cut tensors scaled by the ratio of the dtypes' sizes; times as
    measured); the profile itself when the dtypes agree. Autocast keeps a few tensors in fp32
    (softmax and normalisation statistics): a measured fp32 profile planned at bf16 undercounts them.
    A profile measured at the plan's precision (Profile.precision) has its activation and cut
    counts as measured, its parameter bytes alone converted; one measured at another precision is
    refused (which of its tensors autocast kept in fp32 is not known)."""
    precision = precision_of(opts, profile.dtype, profile.precision)
    measured = profile.precision is not None
    if measured and precision != profile.precision:
        raise ValueError(f"the profile's activation bytes were measured under {profile.precision} (planner profile "
                         f"--precision {profile.precision}), which cannot be converted to --precision {precision}: plan "
                         f"it at {profile.precision}, or profile the model again at that precision")
    target = memory_model.COMPUTE_DTYPE[precision]
    ratio = memory_model.DTYPE_BYTES[target] / memory_model.param_itemsize(profile.dtype)
    if ratio == 1:
        return profile
    activations = 1.0 if measured else ratio
    key = (id(profile), precision)  # bf16 and bf16-mixed share a dtype, not the loss's bytes
    hit = _CONVERTED.get(key)
    if hit is not None and hit[0] is profile:
        return hit[1]

    def scale(table: Dict[int, int]) -> Dict[int, int]:
        # rounded down, every count alike: a part (shared, held, kept) stays within its whole, and
        # every difference of them the ranges take (planner.cost.ranges) stays >= 0
        return {b: int(v * activations) for b, v in table.items()}

    def scale_parts(table: Dict[int, Dict[str, int]]) -> Dict[int, Dict[str, int]]:
        return {b: {key: int(v * activations) for key, v in parts.items()} for b, parts in table.items()}

    def scale_views(table: Dict[int, Dict[str, Dict[str, int]]]) -> Dict[int, Dict[str, Dict[str, int]]]:
        return {b: {x: {v: int(n * activations) for v, n in views.items()} for x, views in parts.items()}
                for b, parts in table.items()}

    def value(v: CutValue) -> CutValue:
        # integer tensors (token ids) keep their size; measured ones their measured dtype
        if v.kind != "tensor" or v.dtype != profile.dtype or measured:
            return v
        return dataclasses.replace(v, dtype=target, bytes=scale(v.bytes))

    # every activation count of a unit (a field left in the profile's dtype beside halved saved
    # bytes made a stage's held bytes negative); the model's inputs are taken as floating too, as
    # saved_bytes, which holds those a unit saves, already is
    units = [dataclasses.replace(u, param_bytes=int(round(u.param_bytes * ratio)),
                                 trainable_bytes=int(round(u.trainable_bytes * ratio)),
                                 saved_bytes=scale(u.saved_bytes), output_bytes=scale(u.output_bytes),
                                 weight_held_bytes=scale(u.weight_held_bytes), input_bytes=scale(u.input_bytes),
                                 loss_saved_bytes=scale(u.loss_saved_bytes),
                                 first_saved_bytes=scale(u.first_saved_bytes),
                                 first_weight_held_bytes=scale(u.first_weight_held_bytes),
                                 weight_kept_bytes=scale(u.weight_kept_bytes),
                                 shared_saved_bytes=scale_parts(u.shared_saved_bytes),
                                 weight_shared_bytes=scale_parts(u.weight_shared_bytes),
                                 recomputed_shared_bytes=scale_parts(u.recomputed_shared_bytes),
                                 dropped_saved_bytes=scale_parts(u.dropped_saved_bytes),
                                 inner_weight_bytes=scale_parts(u.inner_weight_bytes),
                                 inner_kept_bytes=scale_parts(u.inner_kept_bytes),
                                 inner_seed_bytes=scale_parts(u.inner_seed_bytes),
                                 received_parts=scale_views(u.received_parts),
                                 received_saved_parts=scale_views(u.received_saved_parts))
             for u in profile.units]
    if precision == "bf16-mixed" and activations < 1 and units:
        units[-1] = _loss_in_fp32(units[-1], profile.units[-1], ratio)
    cuts = [CutProfile(c.before_unit, [value(v) for v in c.values]) for c in profile.cuts]
    ties = [dict(e, bytes=int(round(e["bytes"] * ratio))) if isinstance(e, dict) and
            isinstance(e.get("bytes"), (int, float)) else e for e in profile.extra.get("shared_parameters", []) or []]
    extra = dict(profile.extra, computed_from_dtype=profile.dtype)
    if "shared_parameters" in extra:
        extra["shared_parameters"] = ties
    converted = dataclasses.replace(profile, units=units, cuts=cuts, dtype=target, extra=extra)
    _CONVERTED[key] = (profile, converted)
    if len(_CONVERTED) > 16:
        _CONVERTED.pop(next(iter(_CONVERTED)))
    return converted


def _loss_in_fp32(scaled: UnitProfile, measured: UnitProfile, ratio: float) -> UnitProfile:
    """The last unit under bf16-mixed: autocast runs torch's losses in fp32 (mse, cross-entropy and
    their kin cast their input up and save it so), so what the loss saves keeps the profile's bytes,
    in the unit's saved bytes (its forward includes the loss) as on their own; the rest is scaled."""
    loss = measured.loss_saved_bytes

    def keep_loss(table: Dict[int, int]) -> Dict[int, int]:
        return {b: int((v - loss.get(b, 0)) * ratio) + loss.get(b, 0) if v >= loss.get(b, 0) else int(v * ratio)
                for b, v in table.items()}

    return dataclasses.replace(scaled, loss_saved_bytes=dict(loss), saved_bytes=keep_loss(measured.saved_bytes),
                               first_saved_bytes=keep_loss(measured.first_saved_bytes))
