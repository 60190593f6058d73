"""Conformance suite: an implementation of `DFlashImplementation` held to the references, component by component."""
