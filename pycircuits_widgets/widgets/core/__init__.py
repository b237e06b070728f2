"""What every view is made of: base class, selection, runner, mixins, wire format, kernel-less answers, bundle.

Imports nothing from ``views`` or ``sharing`` at module import."""
