"""Fault injection: deliberately broken engines, one per known bug class, and the self-test."""
