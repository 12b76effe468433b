//! The `sluice` binary: parse the command line, load the config, serve.

use std::process::ExitCode;

use clap::Parser;
use sluice::cli::{Cli, Command};
use sluice::config;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (Command::Run { config: path } | Command::Check { config: path }) = &cli.command;
    let config = match config::load(path) {
        Ok(config) => config,
        Err(errors) => {
            eprintln!("{errors}");
            return ExitCode::from(2);
        }
    };
    for warning in &config.warnings {
        eprintln!("{warning}");
    }
    match cli.command {
        Command::Check { .. } => {
            println!("{}: ok", path.display());
            ExitCode::SUCCESS
        }
        Command::Run { config: path } => {
            env_logger::Builder::from_env(
                env_logger::Env::default().default_filter_or("warn,sluice=info"),
            )
            .init();
            match sluice::server::run(path, config) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("sluice: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
