//! The verbs both reconcilers use on objects, all as the controller's field manager
//! ([`FIELD_MANAGER`], with its patch parameters from [`params`]): server-side apply of a desired
//! object, create once, adopt what exists under the name the controller would give it (whose it
//! is, [`crate::k8s::ownership`] decides), a merge patch, the status write, deletion (only of what
//! the owner owns; already gone is done), and the label that lets a watch see a Secret the
//! controller reads ([`labelled_secret`]). Each failure is the [`Error`] naming the verb, the
//! kind and the name.

use std::{fmt::Debug, sync::Arc};

use k8s_openapi::{api::core::v1::Secret, apimachinery::pkg::apis::meta::v1::ObjectMeta};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{DeleteParams, Patch, PatchParams, PostParams},
    core::PartialObjectMeta,
    runtime::reflector::{ObjectRef, Store},
};
use serde::{Serialize, de::DeserializeOwned};
use serde_json::json;
use tracing::info;

use crate::{
    k8s::ownership::{Claim, Owner},
    remote::hosting::Target,
    runtime::error::{Error, Result},
};

/// Field manager of every write this controller makes (server-side apply, patches): its name.
pub const FIELD_MANAGER: &str = capk_api::constants::MANAGED_BY;

/// The patch parameters of every patch the controller makes: its field manager, forcing a
/// server-side apply (the fields it applies are its own), plain for merge and strategic patches.
pub fn params<P: Serialize>(patch: &Patch<P>) -> PatchParams {
    match patch {
        Patch::Apply(_) => PatchParams::apply(FIELD_MANAGER).force(),
        _ => PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..Default::default()
        },
    }
}

/// Turns a failed read of `kind` `name` into [`Error::Read`].
pub fn read_error(kind: &'static str, name: &str) -> impl FnOnce(kube::Error) -> Error {
    let name = name.to_owned();
    move |source| Error::Read { kind, name, source }
}

/// Server-side applies `obj`; returns the object as stored.
pub async fn apply<K>(api: &Api<K>, obj: &K, kind: &'static str) -> Result<K>
where
    K: Resource + Clone + Serialize + DeserializeOwned + Debug,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    let patch = Patch::Apply(obj);
    api.patch(&name, &params(&patch), &patch)
        .await
        .map_err(|source| Error::Apply { kind, name, source })
}

/// Creates `obj` unless it exists; returns the stored object and whether it was created.
pub async fn create_if_absent<K>(api: &Api<K>, obj: &K, kind: &'static str) -> Result<(K, bool)>
where
    K: Resource + Clone + Serialize + DeserializeOwned + Debug,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    match api.create(&PostParams::default(), obj).await {
        Ok(o) => Ok((o, true)),
        Err(kube::Error::Api(s)) if s.code == 409 => {
            let o = api.get(&name).await.map_err(read_error(kind, &name))?;
            Ok((o, false))
        }
        Err(source) => Err(Error::Apply { kind, name, source }),
    }
}

/// What [`ensure`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ensured {
    /// Made it.
    Created,
    /// Found it, `owner`'s by its labels or an owner reference, and made it `owner`'s.
    Adopted,
    /// Found it, `owner`'s already.
    Kept,
}

/// Create-or-adopt-or-leave, for an object made once and never patched (a machine Pod, an etcd
/// PVC): with `existing` (what the caller knows is there under the name, from a cache or a
/// read), [`adopt`] it; else [`create_or_adopt`] `desired`. Someone else's object is an error
/// ([`Error::Foreign`]), never taken over.
pub async fn ensure<K>(
    api: &Api<K>,
    kind: &'static str,
    existing: Option<&ObjectMeta>,
    desired: &K,
    owner: &Owner,
    target: &Target,
) -> Result<Ensured>
where
    K: Resource + Clone + Serialize + DeserializeOwned + Debug,
{
    match existing {
        Some(meta) => Ok(adopted(adopt(api, kind, meta, owner, target).await?)),
        None => Ok(create_or_adopt(api, kind, desired, owner, target).await?.1),
    }
}

/// Creates `desired`; when its name is taken, adopts what is there ([`adopt`]). Returns the
/// object as stored.
pub async fn create_or_adopt<K>(
    api: &Api<K>,
    kind: &'static str,
    desired: &K,
    owner: &Owner,
    target: &Target,
) -> Result<(K, Ensured)>
where
    K: Resource + Clone + Serialize + DeserializeOwned + Debug,
{
    let (stored, new) = create_if_absent(api, desired, kind).await?;
    if new {
        return Ok((stored, Ensured::Created));
    }
    let patched = adopt(api, kind, stored.meta(), owner, target).await?;
    Ok((stored, adopted(patched)))
}

fn adopted(patched: bool) -> Ensured {
    if patched {
        Ensured::Adopted
    } else {
        Ensured::Kept
    }
}

/// Makes `meta` (an existing object of the name the controller would give it) `owner`'s:
/// nothing when it already is; its labels and owner references patched when it is the owner's
/// by its labels or an owner reference ([`crate::k8s::ownership`]); an error when it is someone
/// else's. Returns whether it was patched. `meta` may come from a cache, which keeps only the
/// owner references of our kinds ([`crate::k8s::caches`]): the patch, which rewrites the whole list,
/// is made from the object as stored.
pub async fn adopt<K>(
    api: &Api<K>,
    kind: &'static str,
    meta: &ObjectMeta,
    owner: &Owner,
    target: &Target,
) -> Result<bool>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    let name = meta.name.clone().unwrap_or_default();
    let foreign = || Error::Foreign {
        kind,
        name: name.clone(),
        place: target.describe(),
    };
    match crate::k8s::ownership::claim(meta, owner, &target.home) {
        Claim::Current => return Ok(false),
        Claim::Foreign => return Err(foreign()),
        Claim::Adopt(_) => {}
    }
    let Some(stored) = api
        .get_metadata_opt(&name)
        .await
        .map_err(read_error(kind, &name))?
    else {
        return Ok(false);
    };
    let patch = match crate::k8s::ownership::claim(&stored.metadata, owner, &target.home) {
        Claim::Current => return Ok(false),
        Claim::Foreign => return Err(foreign()),
        Claim::Adopt(patch) => patch,
    };
    let patch = Patch::Merge(&patch);
    let _: PartialObjectMeta<K> = api
        .patch_metadata(&name, &params(&patch), &patch)
        .await
        .map_err(|source| Error::Apply {
            kind,
            name: name.clone(),
            source,
        })?;
    info!(kind, name = %name, place = %target.describe(), "adopted");
    Ok(true)
}

/// The metadata of Secret `name` in `ns`, which the controller reads by name and watches by
/// label `(key, value)` (into `cache`): as cached, else as stored. One stored without the label
/// gets it (a merge patch of that label alone), so that the watch sees it from then on and its
/// changes wake the reconciles it concerns: a Secret a user made by hand, without the label
/// Cluster API's contracts ask for, still serves. `None` when it does not exist.
pub async fn labelled_secret(
    client: &Client,
    cache: &Store<PartialObjectMeta<Secret>>,
    ns: &str,
    name: &str,
    (key, value): (&str, &str),
) -> Result<Option<Arc<PartialObjectMeta<Secret>>>> {
    if let Some(cached) = cache.get(&ObjectRef::new(name).within(ns)) {
        return Ok(Some(cached));
    }
    let api: Api<Secret> = Api::namespaced(client.clone(), ns);
    let Some(mut stored) = api
        .get_metadata_opt(name)
        .await
        .map_err(read_error("Secret", name))?
    else {
        return Ok(None);
    };
    // Labelled already: the watch has not shown it yet.
    if !stored.labels().contains_key(key) {
        info!(
            secret = name,
            namespace = ns,
            label = key,
            "labelling a Secret the controller reads, for its watch"
        );
        let patch = json!({"metadata": {"labels": {key: value}}});
        let patch = Patch::Merge(&patch);
        stored = api
            .patch_metadata(name, &params(&patch), &patch)
            .await
            .map_err(|source| Error::Apply {
                kind: "Secret",
                name: name.to_owned(),
                source,
            })?;
    }
    crate::k8s::caches::strip_secret(&mut stored);
    Ok(Some(Arc::new(stored)))
}

/// A JSON merge patch of `obj`; returns the patched object.
pub async fn merge_patch<K>(
    api: &Api<K>,
    obj: &K,
    kind: &'static str,
    patch: &serde_json::Value,
) -> Result<K>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
{
    let patch = Patch::Merge(patch);
    api.patch(&obj.name_any(), &params(&patch), &patch)
        .await
        .map_err(|source| Error::Apply {
            kind,
            name: obj.name_any(),
            source,
        })
}

/// Writes `desired_for(obj)` as the status, only when it differs from the stored status. The
/// watch cache can lag behind our own last write, so the decision is made again on the stored
/// object: a stale copy never causes a redundant write.
pub async fn write_status<K, S>(
    api: &Api<K>,
    obj: &K,
    status_of: impl Fn(&K) -> Option<&S>,
    desired_for: impl Fn(&K) -> S,
) -> Result<()>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
    S: PartialEq + Serialize,
{
    if status_of(obj) == Some(&desired_for(obj)) {
        return Ok(());
    }
    let name = obj.name_any();
    let fresh = api.get_status(&name).await.map_err(Error::UpdateStatus)?;
    let desired = desired_for(&fresh);
    if status_of(&fresh) == Some(&desired) {
        return Ok(());
    }
    let status = json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "status": desired,
    });
    let patch = Patch::Apply(&status);
    api.patch_status(&name, &params(&patch), &patch)
        .await
        .map_err(Error::UpdateStatus)?;
    Ok(())
}

/// Deletes `kind` `name` through `api`; already gone (404) counts as done.
pub async fn delete_if_present<K>(api: &Api<K>, kind: &'static str, name: &str) -> Result<()>
where
    K: Clone + DeserializeOwned + Debug,
{
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(source) => Err(Error::Delete {
            kind,
            name: name.to_owned(),
            source,
        }),
    }
}

/// Deletes `name` when `owner` owns it (its labels or an owner reference); gone is done.
pub async fn delete_if_owned<K>(
    api: &Api<K>,
    kind: &'static str,
    name: &str,
    owner: &Owner,
) -> Result<()>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    let meta = api
        .get_metadata_opt(name)
        .await
        .map_err(read_error(kind, name))?;
    if meta.is_some_and(|m| owner.owns(&m.metadata)) {
        delete_if_present(api, kind, name).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_side_applies_are_forced_and_patches_are_not_both_as_the_controller() {
        let value = json!({});
        let pods = kube::core::Request::new("/api/v1/namespaces/team-a/pods");
        for patch in [
            Patch::Apply(&value),
            Patch::Merge(&value),
            Patch::Strategic(&value),
        ] {
            let p = params(&patch);
            assert_eq!(p.field_manager.as_deref(), Some(FIELD_MANAGER));
            assert_eq!(p.force, matches!(patch, Patch::Apply(_)));
            // kube-rs refuses a forced merge patch before it is sent.
            let request = pods.patch("m", &p, &patch).unwrap();
            assert!(
                request
                    .uri()
                    .query()
                    .unwrap()
                    .contains("fieldManager=capk-controller"),
                "{:?}",
                request.uri()
            );
        }
    }
}
