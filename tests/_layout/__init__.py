"""Tests of _layout."""
