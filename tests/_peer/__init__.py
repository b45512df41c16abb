"""Tests of _peer."""
