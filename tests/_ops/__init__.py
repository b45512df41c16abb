"""Tests of _ops."""
