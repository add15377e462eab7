//! Checkpoints: what an entry needs to go on exactly where it was (model,
//! optimizer and loss-scaler state, plugin states, data position, random
//! generator, batch), on disk and written so that a crash at any instant
//! leaves either the old set of checkpoints or the new one, never a torn one.
//!
//! Layout under an entry's checkpoint directory:
//!
//! ```text
//! step-00000040/
//!   checkpoint.json          manifest: format, the run it belongs to, step,
//!                            data position, batch, every file's size and
//!                            sha256, its own sha256 over all of that, and
//!                            its seal: an HMAC-SHA256 of that sha256 under
//!                            the user's checkpoint key
//!   model.safetensors[.zst]  parameters (rank 0 writes them; ranks hold equal copies)
//!   rank-0.safetensors[.zst] that rank's optimizer and scaler state, RNG state
//!                            and plugin states (`plugin/<slot>`, bytes)
//!   rank-0.json              that file's size and sha256 (gathered into the manifest)
//!   ...
//! ```
//!
//! A write goes to `.step-00000040.tmp/`: every rank writes its files and
//! fsyncs them, the ranks meet, rank 0 writes the manifest, fsyncs it and the
//! directory, renames the directory to its final name and fsyncs the parent.
//! Only a directory with the final name counts. Temporary directories left
//! by a crash are removed when the store is opened.
//!
//! The seal's key is the user's `checkpoints` key, kept outside every
//! checkpoint folder, in the user's state folder
//! ([`harness_format::secrets`]: `$HARNESS_STATE_DIR`, else
//! `~/.local/state/harness`), so whoever can write a checkpoint folder but
//! not that key cannot make a checkpoint this store accepts: files rewritten
//! with their hashes recomputed fail the seal. A later process of the same
//! user on the same machine (`harness run --resume`) holds the same key;
//! a checkpoint taken to another machine or user is refused unless its key
//! goes with it (checkpoints never travel in bundles).
//!
//! Reading treats the folder as hostile ([`accept`], [`confined`]): the
//! checkpoint must be a real directory of regular files (no symbolic link
//! anywhere below the entry's checkpoint directory, which itself and its
//! parent must be real directories; FIFOs and devices are refused from their
//! metadata, unopened), its manifest must be intact (its sha256) and sealed
//! with the user's key (its HMAC), of this
//! run and entry ([`RunIdentity`]), name exactly the files this store
//! writes, and hold a position within what the run could have produced
//! ([`Bounds`]); every file's size is checked against what the run's
//! tensors occupy ([`Layout`]) before it is read, and its header against
//! their names, dtypes and shapes before any tensor is allocated; reads
//! never exceed those sizes. A refusal ([`Refused`]) names the folder and
//! the field.
//!
//! The files: `manifest.rs`, the manifest and file records and how they
//! are read and checked; `store.rs`, [`Store`] (an entry's checkpoint
//! directory: write, commit, list, delete, read); `write.rs`, the files
//! written and hashed; `read.rs`, their verified reads; [`accept`], what a
//! restore accepts; [`confined`], the confined reader; `snapshot.rs`, a
//! rank's part in memory.

mod accept;
pub mod confined;
mod manifest;
mod read;
mod snapshot;
mod store;
mod write;

pub(crate) use accept::refused;
pub use accept::{
    Accept, Bounds, Layout, LrScale, Refused, RunIdentity, TensorSpec, MAX_COUNT, MAX_LR_SCALE, PLUGIN_STATE_BASE,
    PLUGIN_STATE_PER_PARAMETER,
};
pub use manifest::{FORMAT, KEY_NAME};
pub use read::{raw_direct_read, reserve_read_buffers, verify, ReadMode};
pub use snapshot::{Position, Snapshot};
pub use store::{list, Store};
pub use write::{evict_dir, hash_seconds, host_copy, Cancelled};

#[cfg(test)]
mod tests;
