//! The `tcp` transfer backend (to be written).
