"""Tests of _redis."""
