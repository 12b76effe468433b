//! The command line: `sluice run`, `sluice check` and `sluice admin …` (its client: `admin`).

pub mod admin;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "sluice",
    version,
    about = "A rate-limiting reverse proxy for the edge"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Serve with the given config
    Run {
        #[arg(long, short, default_value = "/etc/sluice/sluice.toml")]
        config: PathBuf,
    },
    /// Validate the config and exit: 0 if valid, 2 if not
    Check {
        #[arg(long, short, default_value = "/etc/sluice/sluice.toml")]
        config: PathBuf,
    },
    /// Call the admin API of a running sluice (address and token from the config's [admin])
    Admin {
        #[command(subcommand)]
        call: AdminCall,
        #[arg(long, short, default_value = "/etc/sluice/sluice.toml", global = true)]
        config: PathBuf,
    },
}

/// `sluice admin …`: KEY... are the values of the policy's `key` parts, in order.
#[derive(Subcommand, Debug)]
pub enum AdminCall {
    /// A key's quota, read without charging it
    Quota {
        policy: String,
        #[arg(required = true)]
        key: Vec<String>,
    },
    /// Delete a key's state and ban on every instance (deny caches included)
    Reset {
        policy: String,
        #[arg(required = true)]
        key: Vec<String>,
    },
    /// Every policy with its numbers and overrides
    Policies,
    /// A policy's runtime overrides
    Overrides { policy: String },
    /// Give a key its own numbers on every instance (or, with --delete, the config's again)
    Override {
        policy: String,
        #[arg(required = true)]
        key: Vec<String>,
        #[arg(long, required_unless_present = "delete")]
        limit: Option<u64>,
        /// Delete the key's runtime override
        #[arg(long, conflicts_with_all = ["limit", "burst", "period", "ttl"])]
        delete: bool,
        #[arg(long)]
        burst: Option<u64>,
        /// e.g. "1m"
        #[arg(long)]
        period: Option<String>,
        /// The override expires after this, e.g. "30d"
        #[arg(long)]
        ttl: Option<String>,
    },
    /// This instance's heaviest keys, by rejections then requests
    Top {
        policy: String,
        #[arg(short, default_value_t = 20)]
        n: usize,
    },
    /// Every consumer: name, plan, number of keys, source (config or runtime)
    Consumers,
    /// Create or change a runtime consumer (or, with --delete, delete it and its keys)
    Consumer {
        name: String,
        #[arg(long)]
        plan: Option<String>,
        #[arg(long, conflicts_with = "plan")]
        delete: bool,
    },
    /// A runtime consumer's API keys: `key create NAME`, `key revoke NAME ID`
    Key {
        #[command(subcommand)]
        action: KeyAction,
    },
    /// Write a new random token to FILE (mode 0600), for `[admin] token_file`; no call is
    /// made and the config is not read
    Token { file: PathBuf },
}

#[derive(Subcommand, Debug)]
pub enum KeyAction {
    /// A new random key for NAME, shown once (only its SHA-256 is kept)
    Create { name: String },
    /// Refuse key ID of NAME on every instance
    Revoke { name: String, id: String },
}
