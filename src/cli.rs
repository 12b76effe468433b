//! The command line: `sluice run` and `sluice check`.

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
}
