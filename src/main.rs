//! The `sluice` binary: parse the command line, load the config, serve.

use std::process::ExitCode;

use clap::Parser;
use sluice::cli::{AdminCall, Cli, Command};
use sluice::config;

/// mimalloc rather than glibc's malloc: Pingora allocates and frees buffers and boxed
/// futures on every request (measured in bench/results, issue 13).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::Admin {
        call: AdminCall::Token { file },
        ..
    } = &cli.command
    {
        return match sluice::cli::admin::write_token(file) {
            Ok(()) => {
                println!(
                    "{}: a new admin token, readable by its owner only",
                    file.display()
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("sluice admin token: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let (Command::Run { config: path }
    | Command::Check { config: path }
    | Command::Admin { config: path, .. }) = &cli.command;
    let config = match config::load(path) {
        Ok(config) => config,
        Err(errors) => {
            eprintln!("{errors}");
            return ExitCode::from(2);
        }
    };
    if let Command::Admin { call, .. } = &cli.command {
        return admin(&config, call);
    }
    for warning in &config.warnings {
        eprintln!("{warning}");
    }
    match cli.command {
        Command::Check { .. } => {
            println!("{}: ok", path.display());
            ExitCode::SUCCESS
        }
        Command::Admin { .. } => ExitCode::SUCCESS,
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

/// `sluice admin …`: the answer's body on stdout; exit 1 with it on stderr if the call failed.
fn admin(config: &config::Config, call: &AdminCall) -> ExitCode {
    match sluice::cli::admin::call(&config.admin, call) {
        Ok(answer) if (200..300).contains(&answer.status) => {
            if !answer.body.is_empty() {
                println!("{}", answer.body);
            }
            ExitCode::SUCCESS
        }
        Ok(answer) => {
            eprintln!("sluice admin: {}\n{}", answer.status, answer.body);
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("sluice admin: {e}");
            ExitCode::FAILURE
        }
    }
}
