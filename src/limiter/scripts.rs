//! Placeholder until the Lua scripts land.
