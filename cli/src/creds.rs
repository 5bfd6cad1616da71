//! `volley creds actors`: per-actor NKey identities and the broker config that binds each
//! actor id to one of them (issue 46, item 3; `volley_transport::nats::identity`).

use std::fmt::Write as _;

use anyhow::{bail, Context};
use volley_core::ids::{ActorId, RunId};
use volley_env::EnvServiceName;
use volley_transport::nats::identity::{actor_nkey_variable, actor_user_block, ActorIdentity};

use crate::args::CredsActorsArgs;

/// What `volley creds actors` wrote.
#[derive(Debug, serde::Serialize)]
pub struct CredsSummary {
    /// The seed files, one per identity.
    pub seed_files: Vec<String>,
    /// The user blocks with the identities' public keys, for the account's `users`.
    pub users_conf: String,
    /// `VOLLEY_ACTOR_<index>_NKEY=<public key>` lines for the repo's broker config.
    pub nkeys_env: String,
}

/// Make the identities and write their files.
pub fn creds_actors(args: &CredsActorsArgs) -> anyhow::Result<CredsSummary> {
    let run = RunId::new(args.run.clone()).context("--run")?;
    let services = args
        .env_services
        .iter()
        .filter(|name| !name.is_empty())
        .map(|name| EnvServiceName::new(name.clone()).with_context(|| format!("--env-services {name}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let Some(last) = args.first.checked_add(args.count - 1) else {
        bail!("--first {} + --count {} overflows", args.first, args.count);
    };
    let names = (args.first..=last)
        .map(|index| {
            let name = format!("{}{index}", args.prefix);
            ActorId::new(name.clone())
                .with_context(|| format!("identity name {name:?} (--prefix)"))
                .map(|id| (index, id))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let users_path = args.out.join(format!("actors-{run}.conf"));
    let env_path = args.out.join(format!("actors-{run}.env"));
    for path in [&users_path, &env_path] {
        if path.exists() {
            bail!("{} exists; pick another --out (identities are never overwritten)", path.display());
        }
    }
    let mut users = format!(
        "# Actor identities of run `{run}` made by `volley creds actors`: put these blocks into the `users`\n\
         # list of the account VOLLEY (broker-config/accounts.conf), in place of its actor identity slots.\n"
    );
    let mut env = format!("# Public keys of the actor identities of run `{run}`, for the repo's broker config.\n");
    let mut seed_files = Vec::new();
    for (index, name) in names {
        let identity = ActorIdentity::generate(name).context("the identity name")?;
        let path = identity.write(&args.out)?;
        seed_files.push(path.display().to_string());
        users.push_str(&actor_user_block(&run, identity.name(), identity.public_key(), &services));
        writeln!(env, "{}={}", actor_nkey_variable(index as usize), identity.public_key())
            .expect("writing to a String");
    }
    std::fs::write(&users_path, &users).with_context(|| format!("writing {}", users_path.display()))?;
    std::fs::write(&env_path, &env).with_context(|| format!("writing {}", env_path.display()))?;
    Ok(CredsSummary {
        seed_files,
        users_conf: users_path.display().to_string(),
        nkeys_env: env_path.display().to_string(),
    })
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::args::{Cli, Command, CredsCommand};

    fn args(flags: &[&str]) -> CredsActorsArgs {
        let cli = Cli::try_parse_from(["volley", "creds", "actors"].iter().chain(flags)).expect("valid flags");
        match cli.command {
            Command::Creds(creds) => match creds.command {
                CredsCommand::Actors(args) => args,
            },
            other => panic!("parsed {other:?}"),
        }
    }

    #[test]
    fn creds_actors_writes_one_seed_per_actor_and_their_user_blocks() {
        let dir = tempfile::tempdir().expect("temp dir");
        let out = dir.path().join("ids");
        let out_flag = out.to_str().expect("utf-8 path");
        let summary = creds_actors(&args(&["--count", "3", "--first", "2", "--out", out_flag])).expect("written");
        assert_eq!(summary.seed_files.len(), 3);
        let users = std::fs::read_to_string(out.join("actors-local.conf")).expect("users file");
        let env = std::fs::read_to_string(out.join("actors-local.env")).expect("env file");
        for index in 2..5 {
            let identity = ActorIdentity::read(&out.join(format!("actor-{index}.nk"))).expect("seed file");
            assert_eq!(identity.name().as_str(), format!("actor-{index}"));
            assert!(users.contains(&format!("nkey: {}\n", identity.public_key())));
            assert!(users.contains(&format!("\"volley.local.traj.actor-{index}\"")));
            assert!(env.contains(&format!("VOLLEY_ACTOR_{index}_NKEY={}\n", identity.public_key())));
        }
        let again = creds_actors(&args(&["--count", "1", "--out", out_flag]));
        assert!(again.is_err(), "existing identities are never overwritten");
        assert!(creds_actors(&args(&["--count", "1", "--prefix", "Bad.", "--out", out_flag])).is_err());
    }
}
