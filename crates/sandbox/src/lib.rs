//! `harness-sandbox`: strategies and the plugins that bring them.
//! [`strategy`] holds the three strategy traits the training loop consults
//! (compressor, batch policy, checkpoint policy), their telemetry and the
//! built-in baselines; [`plugin`] puts plugins behind those traits:
//! WebAssembly components sandboxed by wasmtime, or native libraries, with
//! the host ops they call, their budgets, logs and exits.

pub mod plugin;
pub mod strategy;
