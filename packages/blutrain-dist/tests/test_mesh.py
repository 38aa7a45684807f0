"""The mesh layout: row-major coordinates, the last dimension fastest (multi-rank groups are tested
in integration_tests/test_dist_mpi.py)."""

from __future__ import annotations

import itertools

from blutrain.dist.mesh import coordinates, rank_of


def test_coordinates_are_row_major_with_the_last_dimension_fastest() -> None:
    shape = (2, 3, 2)
    assert [coordinates(r, shape) for r in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]


def test_rank_of_inverts_coordinates() -> None:
    shape = (3, 2, 4)
    for coords in itertools.product(*(range(n) for n in shape)):
        assert coordinates(rank_of(coords, shape), shape) == coords
