"""Tests of the routing policies (`policies/`), mirroring its layout."""
