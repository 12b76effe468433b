//! The man pages and the bash and zsh completions, generated from the command line's own
//! definition, so they cannot drift from `--help`. The Debian package ships them (DESIGN §23);
//! `make deb` writes them with the hidden `sluice manuals DIR`.

use std::fs::{self, File};
use std::io;
use std::path::Path;

use clap::CommandFactory;
use clap_complete::shells::{Bash, Zsh};

use super::Cli;

/// Writes into `dir`: `sluice.1` and one page per command (`sluice-run.1`,
/// `sluice-admin-quota.1`, ...: the pages `sluice.1` names), the bash completion
/// `sluice.bash` and the zsh completion `_sluice`.
pub fn write(dir: &Path) -> io::Result<()> {
    fs::create_dir_all(dir)?;
    clap_mangen::generate_to(Cli::command(), dir)?;
    let mut cli = Cli::command();
    clap_complete::generate(
        Bash,
        &mut cli,
        "sluice",
        &mut File::create(dir.join("sluice.bash"))?,
    );
    clap_complete::generate(
        Zsh,
        &mut cli,
        "sluice",
        &mut File::create(dir.join("_sluice"))?,
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_and_completions_cover_every_command() -> io::Result<()> {
        let dir = std::env::temp_dir().join(format!("sluice-manuals-{}", std::process::id()));
        write(&dir)?;
        let page = |name: &str| fs::read_to_string(dir.join(name));
        let main = page("sluice.1")?;
        assert!(main.contains(".TH sluice 1"), "{main}");
        assert!(
            main.contains("sluice\\-run(1)") && main.contains("sluice\\-admin(1)"),
            "{main}"
        );
        assert!(page("sluice-check.1")?.contains("\\-\\-config"));
        assert!(page("sluice-admin-key-revoke.1")?.contains("Refuse key ID of NAME"));
        let bash = page("sluice.bash")?;
        assert!(
            bash.contains("complete -F _sluice") && bash.contains("--config"),
            "{bash}"
        );
        let zsh = page("_sluice")?;
        assert!(
            zsh.starts_with("#compdef sluice") && zsh.contains("override"),
            "{zsh}"
        );
        fs::remove_dir_all(&dir)
    }
}
