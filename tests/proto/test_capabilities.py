"""``TableCapabilities``: the message of ``replay.proto`` as the one declaration both sides read."""

from __future__ import annotations

import dataclasses

import pytest

from replay_proto.capabilities import TableCapabilities
from replay_proto.v1 import replay_pb2 as pb


def test_its_fields_are_the_messages_in_order() -> None:
    assert [f.name for f in dataclasses.fields(TableCapabilities)] == [
        f.name for f in pb.TableCapabilities.DESCRIPTOR.fields]


def test_the_generated_fields_are_the_messages_with_their_zero_values() -> None:
    """``capability_fields`` (read without protobuf) says what the message's descriptor says."""
    from replay_proto.v1.capability_fields import FIELDS

    blank = pb.TableCapabilities()
    assert list(FIELDS) == [(f.name, getattr(blank, f.name))
                            for f in pb.TableCapabilities.DESCRIPTOR.fields]
    assert all(type(zero) is type(getattr(blank, name)) for name, zero in FIELDS)


def test_defaults_are_a_plain_mergeable_row_table() -> None:
    plain = TableCapabilities()
    assert plain.mergeable and plain.n_step == 1 and plain.frame_stack_key == ""
    assert not (plain.priorities or plain.slices or plain.consumes or plain.partial_slices)


def test_a_message_round_trips() -> None:
    caps = TableCapabilities(priorities=True, mergeable=False, n_step=3,
                             frame_stack_key="obs", span_left=2)
    message = caps.to_proto()
    assert isinstance(message, pb.TableCapabilities)
    assert message.n_step == 3 and message.frame_stack_key == "obs" and not message.mergeable
    assert TableCapabilities.from_proto(pb.TableCapabilities.FromString(
        message.SerializeToString())) == caps


def test_it_is_a_frozen_hashable_value() -> None:
    caps = TableCapabilities(slices=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.slices = False  # type: ignore[misc]
    assert {caps, TableCapabilities(slices=True)} == {caps}
    assert dataclasses.replace(caps, episodes=True) == TableCapabilities(slices=True, episodes=True)
